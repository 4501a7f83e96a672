"""Errors as OpenAI-shaped JSON: `{"error": {"message", "type", "param", "code"}}`.

In: exceptions raised anywhere below a route (our own, pydantic's, Starlette's, and any other as
a 500). Out: responses whose status says whose fault it was and whose message names the field and
the limit.
"""
from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from cachesmith.queue_places import EngineClosed, QueueFull
from cachesmith.errors import InputError
from cachesmith.kvstore import StoreWriteFailed
from cachesmith.server.specs import ChunkInUse, SharedChunk, StoreUnavailable, UnknownChunk
from cachesmith.server.tenancy import StoreQuotaExceeded
from cachesmith.shedding import SHED_KIND, SloUnattainable

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500  # of an internal error's own text in a response
STORE_RETRY_AFTER_S = 5  # a store tier that is down is retried after about this (the redis tier's back-off)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def late_error(message: str, retry_after_s: float) -> ApiError:
    """A request that cannot be answered within its SLO (refused at arrival, or shed from the
    queue): a 429 that says when the work ahead will have drained."""
    retry = max(1, math.ceil(retry_after_s))
    return ApiError(429, message, "slo_ms", SHED_KIND, "rate_limit_error", {"Retry-After": str(retry)})


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _is_type_tag(part) -> bool:
    """pydantic names union members and validators in `loc`; they are not fields."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool"))


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body")
    # a union (a document as text or {"id"}) reports every branch; the first names the field
    where = _field(tuple(p for p in first["loc"] if not _is_type_tag(p)))
    details = []
    for e in errors[:3]:
        msg = e["msg"].removeprefix("Value error, ")
        name = _field(tuple(p for p in e["loc"] if not _is_type_tag(p)))
        details.append(msg if name == "body" else f"{name}: {msg}")
    if where == "body" and ":" in details[0]:  # a check over several fields names its field first
        where = details[0].split(":", 1)[0]
    return ApiError(400, "invalid request: " + "; ".join(details), where)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path."""
    scope = {"type": "http", "path": request.url.path, "method": "OPTIONS"}
    methods: set[str] = set()
    for route in request.app.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body exceeds the limit of {max_bytes} bytes (max_body_bytes)", "body",
                    "body_too_large")


def internal_error(exc: BaseException) -> ApiError:
    text = f"{type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode("utf-8")
    return ApiError(500, f"internal error: {text[:MAX_ERROR_CHARS]}", None, "internal_error", "server_error")


class InternalErrors:
    """ASGI middleware, innermost: an exception no handler answered (the server's own failure: a
    disk, memory) becomes a 500 in the API's shape, logged here with its traceback. Not raised
    further: uvicorn would then drop the connection, and a keep-alive client's next request would
    meet a reset. One raised after the answer started (a stream cut short) is, so that it closes."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_started = False

        async def watched(message):
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if is_started:
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await internal_error(exc).response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(UnknownChunk)
    async def unknown_chunk(request: Request, exc: UnknownChunk):
        return ApiError(404, str(exc), str(exc).split("=", 1)[0], "not_found").response()

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError):
        return ApiError(400, str(exc), str(exc).split(":", 1)[0].split("=", 1)[0].strip() or None).response()

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, str(exc), None, "queue_full", "rate_limit_error",
                        {"Retry-After": str(retry)}).response()

    @app.exception_handler(SloUnattainable)
    async def slo_unattainable(request: Request, exc: SloUnattainable):
        return late_error(str(exc), exc.retry_after_s).response()

    @app.exception_handler(EngineClosed)
    async def closed(request: Request, exc: EngineClosed):
        return ApiError(503, str(exc), None, "shutting_down", "server_error").response()

    @app.exception_handler(StoreQuotaExceeded)
    async def store_quota(request: Request, exc: StoreQuotaExceeded):
        return ApiError(429, str(exc), str(exc).split(":", 1)[0], "store_quota_exceeded",
                        "rate_limit_error").response()

    @app.exception_handler(StoreUnavailable)
    @app.exception_handler(StoreWriteFailed)
    async def store_unavailable(request: Request, exc: StoreUnavailable | StoreWriteFailed):
        return ApiError(503, str(exc), None, "store_unavailable", "server_error",
                        {"Retry-After": str(STORE_RETRY_AFTER_S)}).response()

    @app.exception_handler(SharedChunk)
    async def shared_chunk(request: Request, exc: SharedChunk):
        return ApiError(403, str(exc), "chunk_id", "chunk_shared", "permission_error").response()

    @app.exception_handler(ChunkInUse)
    async def in_use(request: Request, exc: ChunkInUse):
        return ApiError(409, str(exc), "chunk_id", "chunk_in_use").response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette lists the first matching route's methods only
            headers["Allow"] = ", ".join(allowed_methods(request))
        return ApiError(exc.status_code, str(exc.detail), None, None, kind, headers).response()
