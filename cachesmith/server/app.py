"""The HTTP API (FastAPI): a thin layer over `Service`.

Routes: `/v1/completions` and `/v1/chat/completions` (OpenAI shape + `documents`, `slo_ms`; SSE
streaming), `/v1/chunks` (add, list, get, delete stored chunks), `/v1/models`, `/health`,
`/metrics` (Prometheus). Errors use OpenAI's `{"error": {"message", "type", "param", "code"}}`:
400 for a bad body (naming the field), 401 without an API key, 403 for deleting a chunk every
tenant shares, 404 for an unknown model or chunk (another tenant's included), 409 for deleting a
chunk in use, 413 over the body limit, 429 + Retry-After when the queue is full, 429 past a store
cap, 500 for the server's own failure, 503 while shutting down. With keys set every route but
`/health` needs one, and the tenant it names (with a request's `cache_salt`) picks the store
namespaces the request reads and writes (`tenancy`). The API key is checked before a body is read; a request takes its place in the queue before any costly work (a 429 costs nothing
but the parsed body); blocking work (admission, chunk prefill) then runs in a worker thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from urllib.parse import quote
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cachesmith.request import RequestResult
from cachesmith.server.config import ServerConfig
from cachesmith.server.errors import ApiError, InternalErrors, install_error_handlers, late_error
from cachesmith.kvstore.keys import MAX_CACHE_SALT
from cachesmith.server.limits import BearerAuth, BodyLimit, tenant_of
from cachesmith.server.metrics import ServiceMetrics
from cachesmith.server.openai_fields import IgnoredFieldsLog
from cachesmith.server.openapi import describe
from cachesmith.server.responses import Shape, completion_body, sse
from cachesmith.server.schemas import (CHUNK_ID_PATTERN, ChatCompletionRequest, ChunksRequest, CompletionRequest,
                                       FeedbackRequest)
from cachesmith.server.service import Service
from cachesmith.server.specs import CompletionSpec
from cachesmith.server.streaming import TokenStream
from cachesmith.server.tenancy import Caller
from cachesmith.shedding import SHED_KIND

log = logging.getLogger(__name__)
IGNORED_HEADER = "x-cachesmith-ignored-fields"
MAX_IGNORED_HEADER = 1024  # characters: proxies refuse long headers
# worker threads beyond the queue's places: /metrics, chunk reads and cancels never wait behind admissions
THREAD_MARGIN = 16


def create_app(service: Service, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServiceMetrics(service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limiter = anyio.to_thread.current_default_thread_limiter()  # this event loop's
        limiter.total_tokens = max(limiter.total_tokens, service.config.max_queue + THREAD_MARGIN)
        yield
        # uvicorn has let in-flight HTTP requests finish; serve whatever is still queued
        await run_in_threadpool(service.close, config.drain_timeout_s)

    app = FastAPI(title="cachesmith", version="0.1.0", lifespan=lifespan)
    app.add_middleware(InternalErrors)  # middleware added first runs last, next to the routes
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.keys:  # added last: it runs first, before the body is read; /metrics and /docs need a key too
        app.add_middleware(BearerAuth, api_keys=config.keys, open_paths=frozenset({"/health"}))
    install_error_handlers(app)
    describe(app, service.config, config.is_strict)
    ignored_log = IgnoredFieldsLog(log)

    @app.get("/health")
    async def health():
        status = "draining" if service.loop.is_closing else "ok"
        return JSONResponse({"status": status, "model": service.config.name, "queue_depth": service.queue_depth,
                             "uptime_s": round(time.time() - service.started_at, 3)},
                            status_code=503 if status == "draining" else 200)

    @app.get("/metrics")
    async def prometheus():
        # in a worker thread: the store-tier-up gauge may wait on a redis PING (up to its timeout)
        body = await run_in_threadpool(metrics.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.config.name, "object": "model",
                                            "created": int(service.started_at), "owned_by": "cachesmith"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(service, body, Shape.COMPLETION, request, config.is_strict, ignored_log)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(service, body, Shape.CHAT, request, config.is_strict, ignored_log)

    @app.post("/v1/feedback")
    async def feedback(body: FeedbackRequest):
        learned = service.feedback(body.id, body.passed)
        if learned is None:
            raise ApiError(404, f"id={body.id!r}: not one of the latest completions of this server", "id",
                           "not_found")
        return {"id": body.id, "object": "feedback", "passed": body.passed, "learned": learned}

    @app.post("/v1/chunks")
    async def add_chunks(body: ChunksRequest, request: Request):
        slot = service.reserve()  # a 429 before any prefill
        try:
            records = await run_in_threadpool(service.add_chunks, body.documents, slot,
                                              Caller(tenant_of(request), body.cache_salt or ""))
        finally:
            slot.release()
        return {"object": "list", "data": [r.to_dict() for r in records]}

    @app.get("/v1/chunks")
    async def list_chunks(request: Request, limit: int = Query(100, ge=1, le=1000),
                          after: str | None = Query(None, pattern=CHUNK_ID_PATTERN),
                          cache_salt: str = Query("", max_length=MAX_CACHE_SALT)):
        records, has_more = await run_in_threadpool(service.list_chunks, limit, after,
                                                    Caller(tenant_of(request), cache_salt))
        return {"object": "list", "data": [r.to_dict() for r in records], "has_more": has_more}

    @app.get("/v1/chunks/{chunk_id}")
    async def get_chunk(request: Request, chunk_id: str = Path(pattern=CHUNK_ID_PATTERN),
                        cache_salt: str = Query("", max_length=MAX_CACHE_SALT)):
        record = await run_in_threadpool(service.chunk, chunk_id, Caller(tenant_of(request), cache_salt))
        if record is None:
            raise ApiError(404, f"chunk {chunk_id!r} is not stored for this model", "chunk_id", "not_found")
        return record.to_dict()

    @app.delete("/v1/chunks/{chunk_id}")
    async def delete_chunk(request: Request, chunk_id: str = Path(pattern=CHUNK_ID_PATTERN),
                           cache_salt: str = Query("", max_length=MAX_CACHE_SALT)):
        if not await run_in_threadpool(service.delete_chunk, chunk_id, Caller(tenant_of(request), cache_salt)):
            raise ApiError(404, f"chunk {chunk_id!r} is not stored for this model", "chunk_id", "not_found")
        return {"id": chunk_id, "object": "chunk", "deleted": True}

    app.state.service, app.state.metrics = service, metrics
    return app


# A client that goes away before its request was scheduled gets the request dropped from the
# queue instead of served to nobody. uvicorn cancels a streaming handler when its client goes, but
# not a plain one, and an ASGI server may report a disconnect only when asked: so both waits poll.
POLL_S = 0.25


async def _done_before_gone(task: asyncio.Future, request: Request) -> bool:
    """Wait for `task`; False if the client disconnected first."""
    while not (await asyncio.wait({task}, timeout=POLL_S))[0]:
        if await request.is_disconnected():
            return False
    return True


async def _drop_if_waiting(service: Service, future) -> None:
    if not future.done():
        with anyio.CancelScope(shield=True):  # this runs in a cancelled task: anyio would cancel it too
            await run_in_threadpool(service.cancel, future)


async def _result_unless_abandoned(future, request: Request, service: Service) -> RequestResult | None:
    """The request's result, or None when its client went away first."""
    waiting = asyncio.wrap_future(future)
    try:
        return waiting.result() if await _done_before_gone(waiting, request) else None
    finally:
        await _drop_if_waiting(service, future)


async def _cancel_if_abandoned(events, request: Request, service: Service, future):
    """Pass the SSE events through until they end or the client goes."""
    pending = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(events, None))
            if not await _done_before_gone(pending, request) or (event := pending.result()) is None:
                return
            yield event
    finally:
        if pending is not None:
            pending.cancel()
        await _drop_if_waiting(service, future)


def _ignored_headers(body: CompletionRequest | ChatCompletionRequest, is_strict: bool,
                     ignored_log: IgnoredFieldsLog) -> dict[str, str]:
    """Fields the request sent that the server does not act on: refused under `--strict` when
    unknown; else logged and named in a response header, so a client can see what had no effect."""
    unknown = sorted(body.model_extra or {})
    if is_strict and unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field (this server runs with --strict); unknown: "
                            f"{', '.join(unknown)}", unknown[0])
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    ignored_log.log(ignored)
    # a header holds latin-1 only, and a body may carry any name of any length: percent-encoded, capped
    # an empty name would leave the header ending in ", ", which HTTP refuses: it shows as ""
    value = ", ".join(quote(name, safe="[]._-") or '""' for name in ignored)
    if len(value) > MAX_IGNORED_HEADER:
        value = value[:MAX_IGNORED_HEADER].rsplit(", ", 1)[0] + ", ..."
    return {IGNORED_HEADER: value}


async def _submit(service: Service, spec: CompletionSpec, stream: TokenStream | None):
    """Take the request's place in the queue first (a 429 before any tokenizing or prefill), then
    admit it in a worker thread; a request refused or failed while admitting is answered now."""
    slot = service.reserve()
    try:
        service.check_arrival(slot, spec)  # sized from its text: a 429 before any thread or tokenizing
        future = await run_in_threadpool(service.submit, spec, stream.on_token if stream else None, slot)
    finally:
        slot.release()  # a no-op once the request is queued
    result = future.result() if future.done() else None
    if result is not None and result.error is not None:
        _raise_if_shed(service, result)
        if result.is_internal_error:
            raise ApiError(500, result.error, None, "internal_error", "server_error")
        # refused while admitting (a prompt past the KV capacity): the documents, else the client's text
        raise ApiError(400, result.error, "documents" if spec.documents else spec.text_field)
    return future


def _raise_if_shed(service: Service, result: RequestResult) -> None:
    """A queued request shed past its deadline: the 429 a request refused at arrival gets, with the
    time the queue ahead takes to drain."""
    if result.error_kind == SHED_KIND:
        raise late_error(result.error, service.loop.retry_after_s())


async def _generate(service: Service, body: CompletionRequest | ChatCompletionRequest, shape: Shape,
                    request: Request, is_strict: bool, ignored_log: IgnoredFieldsLog):
    headers = _ignored_headers(body, is_strict, ignored_log)
    if body.model != service.config.name:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {service.config.name!r}",
                       "model", "model_not_found")
    spec = body.to_spec(tenant_of(request))
    max_tokens = spec.max_tokens or service.config.default_max_tokens
    stream = TokenStream(service.pipeline.tokenizer.decode, body.stops) if body.stream else None
    future = await _submit(service, spec, stream)
    head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": service.config.name}
    service.name_completion(head["id"], future)
    if stream is None:
        result = await _result_unless_abandoned(future, request, service)
        if result is None:
            return Response(status_code=499, headers=headers)  # nginx's "client closed request": nobody reads it
        if result.error is not None:
            _raise_if_shed(service, result)
            raise ApiError(500 if result.is_internal_error else 400, result.error, None,
                           "internal_error" if result.is_internal_error else None,
                           "server_error" if result.is_internal_error else "invalid_request_error")
        return JSONResponse(completion_body(shape, head, result, max_tokens, body.stops,
                                            service.pipeline.tokenizer.token_text), headers=headers)
    stream.watch(future)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_cancel_if_abandoned(sse(shape, head, stream, max_tokens, include_usage,
                                                      service.pipeline.tokenizer.token_text),
                                                  request, service, future),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
