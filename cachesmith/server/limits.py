"""Pure ASGI middleware that answers before a body is read: the API key, then the body size limit.

`BearerAuth` checks `Authorization: Bearer <key>` on the headers alone, so a client without a key
gets a 401 before any of its body is read or parsed; the tenant its key names goes with the request. `BodyLimit`: a declared Content-Length over the
limit is answered at once; a chunked body is counted as it arrives and answered the same way when it
crosses the limit (it is buffered up to the limit, which is small, then replayed to the app). The
answers are in the API's error shape, naming the limit. (Starlette's own limiter answers a declared
length with plain text, outside our handlers.)
"""
from __future__ import annotations

import hmac
from collections.abc import Sequence

from cachesmith.server.errors import ApiError


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, is_replayed = b"".join(chunks), False

        async def replay():
            nonlocal is_replayed
            if is_replayed:  # after the body: whatever the connection says next (a disconnect)
                return await receive()
            is_replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        error = ApiError(413, f"request body exceeds the limit of {self.max_bytes} bytes (max_body_bytes)",
                         "body", "body_too_large")
        await error.response()(scope, receive, send)


class BearerAuth:
    """Every HTTP request but those to `open_paths` needs a bearer key, checked before its body.
    The tenant the key names goes to the request's state (`tenant_of`)."""

    def __init__(self, app, api_keys: Sequence[tuple[str, str]], open_paths: frozenset[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.keys = [(key.encode(), tenant) for key, tenant in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                         "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _tenant(self, scope) -> str | None:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        key, found = key.strip(), None
        for known, tenant in self.keys:  # every key compared, in constant time: no timing tells which
            if hmac.compare_digest(key, known) and found is None:
                found = tenant
        return found


def tenant_of(request) -> str:
    """The tenant of an authorized request ("" on a server without named tenants or keys)."""
    return getattr(request.state, "tenant", "")
