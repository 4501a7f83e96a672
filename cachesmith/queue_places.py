"""A request's place in the live loop's queue, and what the loop answers with.

In: how the loop that handed out a place takes it back. Out: `Slot` (held from a request's
acceptance until it is queued or refused; it builds the engine's `Request` with its id and
arrival), `RequestFuture` (a submitted request's result, by its id), the refusals `QueueFull`
(with a retry-after estimate) and `EngineClosed`, and `AdmissionTurns` (the line admissions wait in
to write the store, one whole admission per turn, first come first served).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from cachesmith.errors import CachesmithError
from cachesmith.kvstore import StoredPrompt
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.request import Request
from cachesmith.scheduler import QueuedRequest
from cachesmith.scoring import Expected


class QueueFull(CachesmithError):
    def __init__(self, depth: int, limit: int, retry_after_s: float) -> None:
        super().__init__(f"queue is full ({depth} requests waiting, max_queue={limit}); "
                         f"retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class EngineClosed(CachesmithError):
    """The loop is shutting down and takes no new requests."""


class RequestFuture(Future):
    """The future result of one submitted request, which `EngineLoop.cancel` takes by its id."""

    def __init__(self, request_id: int) -> None:
        super().__init__()
        self.request_id = request_id


class Slot:
    """One place in the queue, held by a request from its acceptance until it is queued or refused.
    `release` gives it back; only the first call counts, so every path may call it (try/finally)."""

    def __init__(self, give_back: Callable[["Slot"], bool], request_id: int, arrival_s: float) -> None:
        self.request_id = request_id  # the id of the request this place is for
        self.arrival_s = arrival_s  # when the request was accepted: its TTFT starts here
        self.is_released = False
        self.slo_s: float | None = None  # the request's SLO once checked at its arrival
        self.max_tokens = 0  # its answer budget, checked with the SLO
        self.view: QueuedRequest | None = None  # the scheduler's view of it, made at its arrival
        self._give_back = give_back  # the loop's: it takes a place back once

    def request(self, prompt: StoredPrompt, slo_s: float, max_new_tokens: int = 16,
                sampling: SamplingParams = GREEDY, expected: Expected = Expected()) -> Request:
        """The request this place is for: its id, its arrival (when the place was taken)."""
        return Request(self.request_id, prompt, slo_s, max_new_tokens, self.arrival_s, sampling, expected)

    def release(self) -> None:
        self._give_back(self)


class AdmissionTurns:
    """A reentrant lock granted in the order it was asked for: each admission stores its documents,
    its prefix and joins the queue in one turn. With a plain lock, a burst's admissions interleave
    document by document and all end together, each far past the time it was promised; in turns,
    they end one after another, in the order their prices drain (`DeadlineAdmission.busy_s`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0  # the ticket whose turn it is
        self._abandoned: set[int] = set()  # tickets whose waiter gave up (interrupted)
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> "AdmissionTurns":
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                while self._owner is not None or self._serving != ticket:
                    self._cond.wait()
            except BaseException:
                self._abandoned.add(ticket)
                self._advance()
                raise
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("an admission turn was ended by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._advance()

    def _advance(self) -> None:
        """Caller holds the condition: skip abandoned tickets, and wake the waiters."""
        while self._owner is None and self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()
