"""From engine tokens to text deltas on the event loop: what an SSE response reads.

In: `on_token(index, token_id)` calls from the engine's threads and the request's finished
`Future`. Out: `deltas()`, an async iterator of text pieces whose concatenation equals the final
answer (the same stripping and stop-string cut as a non-streamed response), then `result`. The
first token always yields (maybe ""), so a client sees its first event at the first token.
Detokenization is incremental over the whole token list, holding back text that may still change:
an incomplete UTF-8 sequence, trailing whitespace, or a possible start of a stop string.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

from cachesmith.request import RequestResult

_DONE = object()


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def answer_text(result: RequestResult, stop: Sequence[str]) -> tuple[str, bool]:
    """The answer a client sees (cut at the earliest stop string), and whether a stop string cut it."""
    text, is_stopped = cut_at_stop(result.answer, stop)
    return (text.rstrip(), True) if is_stopped else (text, False)


def finish_reason(result: RequestResult, max_tokens: int, stop: Sequence[str]) -> str:
    """OpenAI's finish_reason: "length" when max_tokens ran out first, else "stop"."""
    _, is_stopped = answer_text(result, stop)
    return "length" if not is_stopped and result.num_output_tokens >= max_tokens else "stop"


class TokenStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._decode, self.stop = decode, tuple(stop)
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ids: list[int] = []
        self._sent = ""  # text already yielded
        self.result: RequestResult | None = None

    # engine side (any thread)
    def on_token(self, index: int, token_id: int) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, token_id))

    def watch(self, future: Future) -> None:
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._queue.put_nowait, (_DONE, f)))

    # event-loop side
    async def deltas(self) -> AsyncIterator[str]:
        while True:
            index, item = await self._queue.get()
            if index is _DONE:
                self.result = item.result()
                if self.result.error is None:
                    tail = self._tail(self.result)
                    if tail:
                        yield tail
                return
            self._ids.append(item)  # the engine loop emits each index once, in order
            piece = self._safe_piece()
            if piece or len(self._ids) == 1:  # the first token is announced even if its text is held back
                yield piece

    def _safe_piece(self) -> str:
        text = self._decode(self._ids).lstrip()
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return ""
        cut, is_stopped = cut_at_stop(text, self.stop)
        end = len(cut.rstrip()) if is_stopped else len(text.rstrip())
        if not is_stopped and self.stop:  # a stop string may be starting at the end
            end = min(end, len(text) - max(len(s) for s in self.stop) + 1)
        if end <= len(self._sent) or not text.startswith(self._sent):
            return ""
        piece, self._sent = text[len(self._sent):end], text[:end]
        return piece

    def _tail(self, result: RequestResult) -> str:
        text, _ = answer_text(result, self.stop)
        if not text.startswith(self._sent):  # cannot happen with a prefix-stable tokenizer
            return ""
        tail, self._sent = text[len(self._sent):], text
        return tail
