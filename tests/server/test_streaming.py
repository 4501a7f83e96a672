"""Token stream -> text deltas: pieces concatenate to exactly the non-streamed answer."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from cachesmith.request import RequestResult
from cachesmith.server.streaming import TokenStream, answer_text, cut_at_stop, finish_reason

VOCAB = {0: b" Hello", 1: b",", 2: b" wor", 3: b"ld", 4: b" \xe2\x82", 5: b"\xac", 6: b" END", 7: b"  ", 8: b"!"}


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def result_for(ids, max_tokens=16) -> RequestResult:
    return RequestResult(0, 0.0, 1.0, answer=decode(ids).strip(), first_token_s=0.5,
                         num_output_tokens=len(ids))


def stream(ids, stop=()):
    """Feed tokens from another thread as the engine loop does and collect the deltas."""
    async def run():
        ts = TokenStream(decode, stop)
        future: Future = Future()
        ts.watch(future)

        def engine():
            for i, t in enumerate(ids):
                ts.on_token(i, t)
            future.set_result(result_for(ids))

        threading.Thread(target=engine).start()
        return [piece async for piece in ts.deltas()], ts

    return asyncio.run(run())


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [0, 4, 5, 8], [7, 0, 7, 2, 3, 7], [0, 4]])
def test_deltas_concatenate_to_the_answer(ids):
    pieces, ts = stream(ids)
    assert "".join(pieces) == ts.result.answer == decode(ids).strip()
    assert len(pieces) >= 2 and all(pieces[1:-1])  # the first token always yields; then only text
    assert all("\ufffd" not in p for p in pieces[:-1])  # no half characters mid-stream


def test_stop_strings_cut_both_stream_and_answer():
    pieces, ts = stream([0, 2, 3, 6, 2, 3], stop=[" END", "xyz"])
    text, is_stopped = answer_text(ts.result, ts.stop)
    assert is_stopped and text == "Hello world" == "".join(pieces)
    assert not any("END" in p or "E" in p for p in pieces)
    assert finish_reason(ts.result, 16, ts.stop) == "stop"


def test_finish_reason_length_and_cut():
    res = result_for([0, 2, 3])
    assert finish_reason(res, 3, []) == "length" and finish_reason(res, 4, []) == "stop"
    assert cut_at_stop("a, b. c", [".", ","]) == ("a", True) and cut_at_stop("abc", ["x"]) == ("abc", False)


def test_an_error_result_ends_the_stream_without_text():
    async def run():
        ts = TokenStream(decode)
        future: Future = Future()
        ts.watch(future)
        future.set_result(RequestResult(0, 0.0, 1.0, error="boom", error_kind="internal"))
        return [p async for p in ts.deltas()], ts

    pieces, ts = asyncio.run(run())
    assert pieces == [] and ts.result.error == "boom"
