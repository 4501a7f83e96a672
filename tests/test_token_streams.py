"""A live request's token stream: its sink's calls, its tokens' times, and a failing sink dropped."""
from __future__ import annotations

from cachesmith.clock import ReplayClock
from cachesmith.token_streams import TokenStreams


def test_tokens_reach_their_sink_with_their_times_and_a_failing_sink_stops_alone():
    clock = ReplayClock()
    streams = TokenStreams(clock)
    heard: list[tuple[int, int, int]] = []
    streams.open(1, lambda i, t: heard.append((1, i, t)))
    streams.open(2, lambda i, t: 1 / 0)  # a client gone
    streams.open(3, None)  # nobody streams it: only its times are kept
    for index in range(2):
        clock.advance(0.5)
        for request_id in (1, 2, 3):
            streams.emit(request_id, index, 100 + index)
    assert heard == [(1, 0, 100), (1, 1, 101)]
    assert streams.take_times(1) == (0.5, 1.0) and streams.take_times(1) == ()
    assert streams.take_times(2) == (0.5, 1.0)  # its sink failed; its times were still kept
    streams.close(3)
    assert streams.take_times(3) == ()
