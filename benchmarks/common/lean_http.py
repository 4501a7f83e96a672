"""A load generator's HTTP/1.1 client: each request serialized before it is due, sent on a connection
of its own, and its response parsed with h11 as it arrives.

Why not httpx here: on a 2-core machine shared with the server's compute, building and sending a
request through httpx took the client process longer than the server took to refuse it, so the
time to a refusal measured the client. This client's work per request is a connect, one write and
the parsing of what comes back.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import h11


class Exchange:
    """One JSON POST on a connection of its own, serialized when made: `async with exchange`
    connects and sends it, then `await exchange.response()` (status, headers), then
    `await exchange.body()` or `async for line in exchange.lines()`."""

    def __init__(self, url: str, path: str, payload: dict) -> None:
        parts = urlsplit(url)
        self.addr = (parts.hostname, parts.port)
        body = json.dumps(payload).encode()
        self._conn = h11.Connection(h11.CLIENT)
        self.raw = self._conn.send(h11.Request(method="POST", target=path, headers=[
            ("Host", parts.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ("Connection", "close")])) + self._conn.send(h11.Data(data=body)) + self._conn.send(h11.EndOfMessage())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "Exchange":
        self._reader, self._writer = await asyncio.open_connection(*self.addr)
        self._writer.write(self.raw)
        return self

    async def __aexit__(self, *exc) -> None:
        self._writer.close()

    async def _event(self):
        while True:
            event = self._conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._conn.receive_data(await self._reader.read(65536))

    async def response(self) -> tuple[int, dict[str, str]]:
        event = await self._event()
        if not isinstance(event, h11.Response):
            raise ConnectionError(f"expected a response, got {event!r}")
        return event.status_code, {k.decode().lower(): v.decode() for k, v in event.headers}

    async def _chunks(self) -> AsyncIterator[bytes]:
        while not isinstance(event := await self._event(), (h11.EndOfMessage, h11.ConnectionClosed)):
            yield bytes(event.data)

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks()])

    async def lines(self) -> AsyncIterator[str]:
        pending = b""
        async for chunk in self._chunks():
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                yield line.decode().rstrip("\r")
        if pending:
            yield pending.decode()
