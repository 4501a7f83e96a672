"""Each live request's tokens as they are produced: its consumer's callback and the clock time of
every token.

In: a request's sink (`on_token(index, token_id)`, from the server's stream) when it is queued, and
each token the prefill and decode threads produce. Out: the sink's calls, and the request's token
times (end-to-end latency and the gaps between tokens) when its result is made. A sink that raises
(a client gone) gets no more tokens; the other streams go on.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from cachesmith.clock import Clock

log = logging.getLogger(__name__)

TokenSink = Callable[[int, int], None]  # (index in the answer, token id)


class TokenStreams:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._sinks: dict[int, TokenSink] = {}
        self._times: defaultdict[int, list[float]] = defaultdict(list)  # per request, its tokens' times

    def open(self, request_id: int, sink: TokenSink | None) -> None:
        if sink is not None:
            self._sinks[request_id] = sink

    def emit(self, request_id: int, index: int, token_id: int) -> None:
        # one clock read and append per token
        self._times[request_id].append(self._clock.now())
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink(index, token_id)
        except Exception:  # a consumer's failure must not stop the others
            log.exception("token sink of request %d failed; it gets no more tokens", request_id)
            self._sinks.pop(request_id, None)

    def take_times(self, request_id: int) -> tuple[float, ...]:
        """The request's token times so far, forgotten here."""
        return tuple(self._times.pop(request_id, ()))

    def close(self, request_id: int) -> None:
        """The request is answered (or failed after some first tokens): nothing more is kept."""
        self._sinks.pop(request_id, None)
        self._times.pop(request_id, None)
