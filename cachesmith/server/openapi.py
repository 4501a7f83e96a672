"""The published OpenAPI schema says what the server really answers.

In: the FastAPI app with its routes. Out: `describe(app)`, which replaces FastAPI's generated
schema with one whose responses are the real ones: every error status a route can give, with
OpenAI's error body (FastAPI documents a 422 we never send, since validation errors are 400s
here), `/metrics` as Prometheus text, the headers that come with 429 (`Retry-After`) and 401, and
the one model name the server serves.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


_WHY = {400: "a bad request: the message names the field and the limit",
        401: "missing or wrong API key", 404: "unknown model or chunk", 409: "the chunk is in use",
        413: "body over the size limit", 429: "the queue is full", 499: "the client went away",
        503: "shutting down"}
_HEADERS = {429: {"Retry-After": {"description": "seconds until the queue is expected to have room",
                                  "schema": {"type": "integer"}}},
            401: {"WWW-Authenticate": {"schema": {"type": "string"}}}}
_ROUTES = {  # (path, method) -> error statuses besides 400/401/413, which any authed route may give
    ("/v1/completions", "post"): (404, 429, 503), ("/v1/chat/completions", "post"): (404, 429, 503),
    ("/v1/chunks", "post"): (503,), ("/v1/chunks", "get"): (), ("/v1/chunks/{chunk_id}", "get"): (404,),
    ("/v1/chunks/{chunk_id}", "delete"): (404, 409), ("/v1/models", "get"): (), ("/metrics", "get"): (),
    ("/health", "get"): (503,),
}
_OPEN = {("/health", "get")}  # no key needed, no body


def _error(status: int) -> dict:
    out = {"description": _WHY[status],
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    if status in _HEADERS:
        out["headers"] = _HEADERS[status]
    return out


def describe(app: FastAPI, model_name: str) -> None:
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
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text exposition",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
        for name in ("ValidationError", "HTTPValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):  # any other name is a 404
            if name in components:
                components[name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
        app.openapi_schema = spec
        return spec

    app.openapi = schema
