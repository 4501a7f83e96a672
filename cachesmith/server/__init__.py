"""The HTTP server: an OpenAI-compatible API over `Service` (the live engine loop and the store).

`cachesmith serve` runs it with uvicorn; `create_app(service)` gives the ASGI app for tests or an
embedding application; `run_server` blocks until SIGINT/SIGTERM, then drains.
"""
from cachesmith.server.app import create_app
from cachesmith.server.config import ServerConfig
from cachesmith.server.run import run_server
from cachesmith.server.service import Service
from cachesmith.server.specs import ChunkInUse, CompletionSpec, DocumentRef, ServiceConfig

__all__ = ["ChunkInUse", "CompletionSpec", "DocumentRef", "ServerConfig", "Service", "ServiceConfig",
           "create_app", "run_server"]
