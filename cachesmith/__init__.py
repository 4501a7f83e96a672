"""cachesmith: RAG prefill serving with cached chunk KV and budgeted selective recomputation.

`cachesmith.Engine` (the serving loop), `EngineConfig`, `Request`, `RagPipeline` (one answer) are
imported on first use, so `import cachesmith` and the CLI's help stay light.
"""
__version__ = "0.1.0"

import importlib

# each name's module, imported by a literal name so that the layering test sees the edge
_LAZY = {"Engine": lambda: importlib.import_module("cachesmith.engine"),
         "EngineConfig": lambda: importlib.import_module("cachesmith.engine"),
         "Request": lambda: importlib.import_module("cachesmith.request"),
         "RequestResult": lambda: importlib.import_module("cachesmith.request"),
         "RagPipeline": lambda: importlib.import_module("cachesmith.pipeline")}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(_LAZY[name](), name)
    raise AttributeError(f"module 'cachesmith' has no attribute {name!r}")
