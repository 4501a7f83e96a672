"""Refusing what cannot be answered in time, at arrival and at each batch boundary, by the one
rule of `scheduler.feasibility`: a request is answered refused (`SLO_UNATTAINABLE`) when it is not
feasible at the shedding margin (`--shed-late`, `SheddingConfig.max_lateness`).

In (from the live loop, under its lock): a request's scheduler view and the token counts of its
documents not yet stored, at arrival (sized from its text) and again after tokenizing, before any
of them is prefilled; the queue at each batch boundary; the batch each decision starts. Out:
`SloUnattainable` for a request refused at arrival, and the queued requests to answer refused
instead of running. An admitted request is work ahead of later arrivals (its documents' prefill
and its batch) until it is queued, so a burst is refused in order.

Why refuse rather than queue: a first token past its SLO is useless to its client, and a request
served late makes every request behind it later still (Clockwork, OSDI '20, drops what cannot meet
its deadline for the same reason).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cachesmith.errors import CachesmithError
from cachesmith.scheduler.feasibility import DeadlinePricer, PromptSize, SheddingConfig, TtftEstimate, infeasible, judge
from cachesmith.scheduler.types import QueuedRequest

SHED_KIND = "slo_unattainable"  # a refused result's `error_kind`, the API's error code


class SloUnattainable(CachesmithError):
    """A request whose earliest first token is past its SLO by more than the margin (a 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(estimate: TtftEstimate, slo_s: float, max_lateness: float) -> float:
    """When the same request sent again would be within the margin, if nothing else arrives: the
    work ahead drains at the clock's pace. A request too large to be in time even alone is told
    when the work ahead is done (a retry then is at least priced with nothing ahead)."""
    room = max_lateness * slo_s - estimate.own_s
    return max(estimate.start_s - room, 0.0) if room > 0 else estimate.start_s


def late_message(estimate: TtftEstimate, slo_s: float, max_lateness: float, retry_s: float) -> str:
    alone = estimate.own_s > max_lateness * slo_s
    why = ("even alone on an idle server its cheapest plan takes longer: raise slo_ms or send fewer new "
           "documents" if alone else f"retry after {math.ceil(max(retry_s, 1.0))} s, when the work ahead has drained")
    return (f"slo_ms={slo_s * 1e3:.0f}: this request cannot be answered in time: its first token would come at "
            f"the earliest after {estimate.describe()}, past {max_lateness:g}x its SLO (--shed-late); {why}")


class DeadlineAdmission:
    """The loop's record of the work promised ahead of each new request. Every call is made under
    the loop's lock."""

    def __init__(self, pricer: DeadlinePricer, config: SheddingConfig) -> None:
        self.pricer, self.config = pricer, config
        # slot id -> (its documents' prefill s, its batch alone s, since): admissions in progress
        self._admitting: dict[int, tuple[float, float, float]] = {}
        self._settled_s = -math.inf  # when an admission last ended: those after it prefill from then
        self.batch_ends_s = 0.0  # clock time the batch prefilling now ends at its cheapest (0: none runs)

    def busy_s(self, now: float, request_id: int | None = None) -> float:
        """Work before anything new can start: the rest of the running batch, and each admission in
        progress: the rest of its documents' prefill, then its batch alone. Admissions take turns
        (`AdmissionTurns`), so their prefills drain one after another, in the order they were
        promised, none before the last admission ended; each batch is alone, since its request joins
        the queue only once its documents are stored, after the requests queued now were batched."""
        ends_s, runs_s = -math.inf, 0.0
        others = sorted((v for i, v in self._admitting.items() if i != request_id), key=lambda v: v[2])
        for prefill_s, run_s, since in others:
            ends_s = max(ends_s, since, self._settled_s) + prefill_s
            runs_s += run_s
        return max(self.batch_ends_s - now, 0.0) + max(ends_s - now, 0.0) + runs_s

    def admit(self, view: QueuedRequest, now: float, queued: Sequence[QueuedRequest],
              num_new_tokens: Sequence[int]) -> TtftEstimate | None:
        """After tokenizing: `SloUnattainable` (promising nothing) when the request is not feasible;
        else its estimate (None with shedding off), its work promised ahead of later arrivals until
        it is queued."""
        return self._promise(view, now, queued, num_new_tokens, is_guessed=False)

    def check_arrival(self, view: QueuedRequest, now: float, queued: Sequence[QueuedRequest],
                      size: PromptSize) -> None:
        """Before tokenizing, as `admit`: `view`'s counts and its documents' tokens not yet stored
        are guessed from its text (`size`)."""
        self._promise(view, now, queued, self.pricer.sizes.guess(size)[2], is_guessed=True)

    def _promise(self, view: QueuedRequest, now: float, queued: Sequence[QueuedRequest],
                 num_new_tokens: Sequence[int], is_guessed: bool) -> TtftEstimate | None:
        if not self.config.is_on:
            return None
        verdict = judge(self.pricer, view, now, queued, self.config.max_lateness, self.busy_s(now, view.request_id),
                        num_new_tokens)
        # sized from its text, only the work ahead refuses it: its own size is a guess, and a prompt
        # too large alone is refused after tokenizing, where one past the model's limits is named first
        if not verdict.is_feasible and (not is_guessed or verdict.estimate.start_s > 0):
            self.settle(view.request_id)
            raise self._refusal(verdict.estimate, view.slo_s, is_guessed)
        self._admitting[view.request_id] = (verdict.estimate.prefill_s, verdict.estimate.run_s, now)
        return verdict.estimate

    def _refusal(self, estimate: TtftEstimate, slo_s: float, is_guessed: bool) -> SloUnattainable:
        retry = retry_after_s(estimate, slo_s, self.config.max_lateness)
        message = late_message(estimate, slo_s, self.config.max_lateness, retry)
        if is_guessed:
            message += " (its own work sized from its text's length, before tokenizing)"
        return SloUnattainable(message, retry)

    def start_batch(self, batch: Sequence[QueuedRequest], now: float) -> None:
        """A batch of these requests starts prefilling: its cheapest price is work ahead of every
        arrival until it ends (its budget would count the slack the planner may spend, and a batch
        that ends early would go on counting it)."""
        self.batch_ends_s = now + (self.pricer.cheapest_s(batch) if batch else 0.0)

    def end_batch(self) -> None:
        self.batch_ends_s = 0.0

    def settle(self, request_id: int, now: float | None = None) -> None:
        """The admission ended at `now` (queued, or refused): its documents are stored or never will
        be."""
        if self._admitting.pop(request_id, None) is not None and now is not None:
            self._settled_s = max(self._settled_s, now)

    def expired(self, queue: Sequence[QueuedRequest], now: float) -> list[tuple[QueuedRequest, str]]:
        """At a batch boundary: the queued requests not feasible at the margin, each with the message
        its client gets."""
        if not self.config.is_on:
            return []
        return [(v.request, f"slo_ms={v.request.slo_s * 1e3:.0f}: this request waited {v.estimate.waited_s:.2f} s "
                            f"in the queue; behind {v.estimate.start_s:.2f} s of work due first and its own "
                            f"{v.estimate.run_s:.2f} s at its cheapest plan its first token would come past "
                            f"{self.config.max_lateness:g}x its SLO (--shed-late), so it was not run")
                for v in infeasible(self.pricer, queue, now, self.config.max_lateness)]
