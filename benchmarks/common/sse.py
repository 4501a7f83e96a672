"""The benchmarks' one reader of a streamed (SSE) chat or text completion: the time to the first
token, the text, the error events and the server's own `cachesmith` object.

In: the response's lines, from any client (httpx's `aiter_lines()`, `lean_http.Exchange.lines()`),
and `ttft_at`, which event ends the time to the first token. The benchmarks' published numbers
each came from one of these, so each keeps its own:
- "line": any `data:` line, `[DONE]` too (the soak: a stream that said anything has started);
- "event": any event but `[DONE]`, an error event too (serve_load: the first SSE event);
- "answer": any event but `[DONE]` and error events (overload: an error is a refusal, not an answer);
- "text": the first event with text (vllm_anchor: vLLM and llama.cpp first send an empty role delta).
Out: the `Stream`'s fields, filled as lines arrive, so what came before a cut stream is kept.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

TTFT_AT = ("line", "event", "answer", "text")


class Stream:
    """One streamed response, read by `read`. `sent` is the clock when the stream was made (make it
    as the request is sent), `first` the clock at the event `ttft_at` names (None: none came)."""

    def __init__(self, ttft_at: str, clock: Callable[[], float] = time.perf_counter) -> None:
        if ttft_at not in TTFT_AT:
            raise ValueError(f"ttft_at {ttft_at!r}: one of {', '.join(TTFT_AT)}")
        self.ttft_at, self.clock = ttft_at, clock
        self.sent, self.first = clock(), None
        self.pieces: list[str] = []  # each event's text, in order
        self.errors: list[dict] = []  # each error event's `error` object, in order
        self.final: dict | None = None  # the last `cachesmith` object the server sent
        self.is_done = False  # `[DONE]` came

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _mark(self, at: str) -> None:
        if self.first is None and self.ttft_at == at:
            self.first = self.clock()

    async def read(self, lines: AsyncIterator[str]) -> "Stream":
        async for line in lines:
            if not line.startswith("data: "):
                continue
            self._mark("line")
            if line == "data: [DONE]":
                self.is_done = True
                continue
            self._mark("event")
            event = json.loads(line[len("data: "):])
            if "error" in event:
                self.errors.append(event["error"])
                continue
            self._mark("answer")
            # a chat chunk's choice carries a delta, a text completion's its text
            text = "".join((c["delta"].get("content") if "delta" in c else c.get("text")) or ""
                           for c in event.get("choices", []))
            if text:
                self._mark("text")
            self.pieces.append(text)
            self.final = event.get("cachesmith", self.final)
        return self
