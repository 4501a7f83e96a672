"""`benchmarks/common/lean_http.py`, the overload benchmark's client, against a raw asyncio server: the
request it sends is the JSON POST it was made from, a refusal's status, headers and body, and a
chunked event stream split into lines across chunk boundaries."""
from __future__ import annotations

import asyncio
import json

from benchmarks.common.lean_http import Exchange

REFUSAL = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 3\r\n"
           b"content-length: 27\r\nconnection: close\r\n\r\n" + b'{"error": {"code": "late"}}')
STREAM = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
          b"7\r\ndata: {\r\n", b"9\r\n\"a\": 1}\n\n\r\n", b"e\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"]


async def _serve(replies: list[list[bytes]], seen: list[bytes]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(lengths[0])
        seen.append(head + await reader.readexactly(length))
        for part in replies.pop(0):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)  # each part its own read
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_refusal_and_a_chunked_stream_are_read_as_sent():
    async def run():
        seen: list[bytes] = []
        server = await _serve([[REFUSAL], STREAM], seen)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        refused = Exchange(url, "/v1/chat/completions", {"slo_ms": 20})
        async with refused:
            status, headers = await refused.response()
            body = json.loads(await refused.body())
        streamed = Exchange(url, "/v1/chat/completions", {"stream": True})
        async with streamed:
            streamed_status, _ = await streamed.response()
            lines = [line async for line in streamed.lines()]
        server.close()
        return seen, status, headers, body, streamed_status, lines

    seen, status, headers, body, streamed_status, lines = asyncio.run(run())
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and seen[0].endswith(b'{"slo_ms": 20}')
    assert (status, headers["retry-after"], body) == (429, "3", {"error": {"code": "late"}})
    assert streamed_status == 200
    assert lines == ['data: {"a": 1}', "", "data: [DONE]", ""]
