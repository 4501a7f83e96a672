"""cachesmith: RAG prefill serving with cached chunk KV and budgeted selective recomputation.

`cachesmith.Engine` (the serving loop), `EngineConfig`, `Request`, `RagPipeline` (one answer) are
imported on first use, so `import cachesmith` and the CLI's help stay light.
"""
__version__ = "0.1.0"

_LAZY = {"Engine": "cachesmith.engine", "EngineConfig": "cachesmith.engine", "Request": "cachesmith.request",
         "RequestResult": "cachesmith.request", "RagPipeline": "cachesmith.pipeline"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cachesmith' has no attribute {name!r}")
