"""The benchmarks' one reader of a streamed completion (`benchmarks.common.sse`): where each client's
time to the first token ends, the text of chat and text completions, error events, the server's
`cachesmith` object, and what arrived before a stream was cut."""
from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.common.sse import Stream

ROLE = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}  # vLLM's first event: no text
ERROR = {"error": {"code": "slo_unattainable", "type": "server_error", "message": "late"}}
TEXT = {"choices": [{"delta": {"content": "Paris"}}]}
FINAL = {"choices": [{"delta": {"content": "."}}], "cachesmith": {"ttft_ms": 250.0}}


class Feed:
    """The lines of a response, and a clock that reads how many of them have arrived."""

    def __init__(self, *items) -> None:
        self.items, self.arrived = items, 0

    def clock(self) -> int:
        return self.arrived

    async def lines(self):
        for item in self.items:
            self.arrived += 1
            if isinstance(item, Exception):
                raise item
            yield item


def data(event) -> str:
    return "data: " + (event if isinstance(event, str) else json.dumps(event))


def read(ttft_at: str, *items) -> Stream:
    feed = Feed(*items)
    stream = Stream(ttft_at, clock=feed.clock)
    asyncio.run(stream.read(feed.lines()))
    return stream


@pytest.mark.parametrize("ttft_at, first", [("line", 2), ("event", 3), ("answer", 4), ("text", 5)])
def test_each_client_ends_its_ttft_at_its_own_event(ttft_at, first):
    stream = read(ttft_at, ": keep-alive", data("[DONE]"), data(ERROR), data(ROLE), data(TEXT), data(FINAL))
    assert stream.first == first and stream.ttft_s == first  # no line had arrived when it was made
    assert stream.text == "Paris." and stream.errors == [ERROR["error"]] and stream.final == FINAL["cachesmith"]
    assert stream.is_done


def test_a_text_completions_text_is_read_too():
    stream = read("text", data({"choices": [{"text": "Par"}]}), data({"choices": [{"text": "is"}]}), data("[DONE]"))
    assert stream.text == "Paris" and stream.first == 1


def test_a_stream_without_text_or_done_has_no_first_token():
    stream = read("text", data(ROLE), "")
    assert stream.ttft_s is None and stream.text == "" and not stream.is_done


def test_what_came_before_a_cut_is_kept():
    feed = Feed(data(ERROR), ConnectionError("cut"))
    stream = Stream("line", clock=feed.clock)
    with pytest.raises(ConnectionError):
        asyncio.run(stream.read(feed.lines()))
    assert stream.first == 1 and stream.errors == [ERROR["error"]] and not stream.is_done


def test_an_unknown_ttft_event_is_refused():
    with pytest.raises(ValueError, match="ttft_at"):
        Stream("token")
