"""The published OpenAPI schema says what the server really answers.

In: the FastAPI app with its routes. Out: `describe(app)`, which replaces FastAPI's generated
schema with one whose responses are the real ones: every error status a route can give, with
OpenAI's error body (FastAPI documents a 422 we never send, since validation errors are 400s
here), `/metrics` as Prometheus text, the headers that come with 429 (`Retry-After`) and 401, and
the one model name the server serves, and the service's limits (max_tokens, slo_ms, documents).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from cachesmith.server.specs import ServiceConfig


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


_WHY = {400: "a bad request: the message names the field and the limit",
        401: "missing or wrong API key", 404: "unknown model, chunk or completion", 409: "the chunk is in use",
        403: "the chunk is shared by every tenant (the operator removes it)",
        413: "body over the size limit",
        429: "the queue is full (requests, chunk uploads waiting or being admitted; Retry-After), the request "
             "cannot be answered within its SLO by the shedding margin (code slo_unattainable; Retry-After), or "
             "it would store more than a store cap allows (code store_quota_exceeded)",
        499: "the client went away", 503: "shutting down, or a store tier cannot delete now (retry)"}
_HEADERS = {429: {"Retry-After": {"description": "seconds until the queue is expected to have room (a full "
                                                 "queue, the work ahead of a request refused as late; a "
                                                 "store cap sends none)", "required": False,
                                  "schema": {"type": "integer"}}},
            401: {"WWW-Authenticate": {"schema": {"type": "string"}}}}
_ROUTES = {  # (path, method) -> error statuses besides 400/401/413, which any authed route may give
    ("/v1/completions", "post"): (404, 429, 503), ("/v1/chat/completions", "post"): (404, 429, 503),
    ("/v1/chunks", "post"): (429, 503), ("/v1/chunks", "get"): (), ("/v1/chunks/{chunk_id}", "get"): (404,),
    ("/v1/chunks/{chunk_id}", "delete"): (403, 404, 409, 503), ("/v1/models", "get"): (), ("/metrics", "get"): (),
    ("/health", "get"): (503,), ("/v1/feedback", "post"): (404,),
}
_EVENT = {  # one server-sent event (OpenAPI 3.2's reading of an event stream's schema)
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk's JSON, or `[DONE]` last"},
                   "event": {"type": "string"}}}
_OPEN = {("/health", "get")}  # no key needed, no body


def _error(status: int) -> dict:
    out = {"description": _WHY[status],
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    if status in _HEADERS:
        out["headers"] = _HEADERS[status]
    return out


def _limits(body: dict, config: ServiceConfig) -> None:
    """The service's configured limits, which the request models cannot know."""
    props = body["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name]["anyOf"][0]["maximum"] = config.max_tokens_limit
    props["slo_ms"]["anyOf"][0].update(minimum=config.min_slo_s * 1e3, maximum=config.max_slo_s * 1e3)
    props["documents"]["maxItems"] = config.max_documents


def _chunk_links(spec: dict) -> None:
    """OpenAPI links from storing chunks to reading and deleting the first of them, so a client
    generator (or a stateful fuzzer) knows where a chunk id comes from."""
    item = spec["paths"].get("/v1/chunks/{chunk_id}", {})
    stored = spec["paths"].get("/v1/chunks", {}).get("post")
    if stored is None:
        return
    stored["responses"]["200"]["links"] = {
        f"{method.capitalize()}Chunk": {"operationId": item[method]["operationId"],
                                        "parameters": {"chunk_id": "$response.body#/data/0/id"}}
        for method in ("get", "delete") if method in item}


def describe(app: FastAPI, config: ServiceConfig, is_strict: bool = False) -> None:
    """Install the published schema; `is_strict`: completion bodies refuse unknown fields."""
    def schema() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(components["ErrorBody"].pop("$defs", {}))
        for (path, method), extra in _ROUTES.items():
            op = spec["paths"].get(path, {}).get(method)
            if op is None:
                continue
            responses = op["responses"]
            responses.pop("422", None)
            statuses = extra if (path, method) in _OPEN else (400, 401, 413, *extra)
            for status in statuses:
                responses[str(status)] = _error(status)
            if method == "post" and path.endswith("completions"):  # stream=true answers as server-sent events
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": _EVENT}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text exposition",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
        _chunk_links(spec)
        for name in ("ValidationError", "HTTPValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):  # any other name is a 404
            if name in components:
                components[name]["properties"]["model"] = {"type": "string", "enum": [config.name]}
                components[name]["additionalProperties"] = not is_strict
                _limits(components[name], config)
        app.openapi_schema = spec
        return spec

    app.openapi = schema
