"""Deadline-aware admission: a request that cannot be answered in time is refused at once, not
queued to be answered late.

In (from the live loop, under its lock): a request's scheduler view and the token counts of its
documents not yet stored, at arrival, before any of them is prefilled; the queue at each batch
boundary; the batch each decision starts; each admitted request's measured TTFT. Out: a
`TtftEstimate` for a request admitted (its promise, so the server can report how good the
estimates are), `SloUnattainable` for one refused at arrival, and the queued requests whose
deadline has passed by the margin, to be answered refused instead of run. Prices come from
`scheduler.deadline`: the cheapest plan of everything ahead, a lower bound, times how much later
than that bound the requests served at their cheapest plan really came (`EstimateErrors`), so a
refusal means that even the cheapest service would, as this server runs, be later than the margin
allows, and an admitted request lands within it.

Why refuse rather than queue: a first token past its SLO is useless to its client, and a request
served late makes every request behind it later still (Clockwork, OSDI '20, drops what cannot meet
its deadline for the same reason).
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Sequence

from cachesmith.errors import CachesmithError
from cachesmith.recompute import parse_label
from cachesmith.scheduler.deadline import FULL_REUSE, DeadlinePricer, PromptSize, SheddingConfig, TtftEstimate
from cachesmith.scheduler.types import QueuedRequest

SHED_KIND = "slo_unattainable"  # a refused result's `error_kind`, the API's error code
CHEAPEST_WINDOW = 64  # requests served at their cheapest plan the lateness ratio is the median of
MIN_CHEAPEST = 4  # measured before the ratio applies (until then: 1, the bound as priced)
MAX_LATENESS_RATIO = 2.0  # a burst of slow batches (page faults, a busy machine) must not refuse all


class SloUnattainable(CachesmithError):
    """A request whose earliest first token is past its SLO by more than the margin (a 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(estimate: TtftEstimate, slo_s: float, max_lateness: float) -> float:
    """When the same request sent again would be within the margin, if nothing else arrives: the
    work ahead drains at the clock's pace. A request too large to be in time even alone is told
    when the work ahead is done (a retry then is at least served at once)."""
    room = max_lateness * slo_s - estimate.own_s
    return max(estimate.start_s - room, 0.0) if room > 0 else estimate.start_s


def late_message(estimate: TtftEstimate, slo_s: float, max_lateness: float, retry_s: float,
                 ratio: float = 1.0) -> str:
    """`estimate`: as expected here (the priced bound times `ratio`, `EstimateErrors.lateness_ratio`)."""
    alone = estimate.own_s > max_lateness * slo_s
    why = ("even alone on an idle server its cheapest plan takes longer: raise slo_ms or send fewer new "
           "documents" if alone else f"retry after {math.ceil(max(retry_s, 1.0))} s, when the work ahead has drained")
    paced = "" if ratio == 1.0 else (f" (the cheapest plans' price x {ratio:.2f}, how much later requests served "
                                     f"at their cheapest plan came here)")
    return (f"slo_ms={slo_s * 1e3:.0f}: this request cannot be answered in time: its first token would come at "
            f"the earliest after {estimate.describe()}{paced}, past {max_lateness:g}x its SLO (--shed-late); {why}")


class DeadlineAdmission:
    """The loop's record of the work promised ahead of each new request. Every call is made under
    the loop's lock."""

    def __init__(self, pricer: DeadlinePricer, config: SheddingConfig) -> None:
        self.pricer, self.config = pricer, config
        self.errors = EstimateErrors()  # admitted requests' measured / estimated TTFT
        self._admitting: dict[int, tuple[float, float, float]] = {}  # slot id -> (prefill s, run s, since)
        self._cheapest: dict[int, float] = {}  # queued request id -> its batch alone at full reuse
        self._alone_late: set[int] = set()  # admitted past the margin with nothing ahead: not shed
        self.batch_ends_s = 0.0  # clock time the batch prefilling now ends at its cheapest (0: none runs)

    def busy_s(self, now: float, request_id: int | None = None) -> float:
        """Work promised before anything new can start: the rest of the running batch, and each
        admission in progress (the rest of its documents' prefill, then its batch)."""
        left = max(self.batch_ends_s - now, 0.0)
        for slot_id, (prefill_s, run_s, since) in self._admitting.items():
            if slot_id != request_id:
                left += max(prefill_s - (now - since), 0.0) + run_s
        return left

    def admit(self, view: QueuedRequest, now: float, ahead: Sequence[QueuedRequest],
              num_new_tokens: Sequence[int]) -> TtftEstimate:
        """The request's estimate, counted as work ahead of later arrivals until it is queued; raises
        `SloUnattainable` (counting nothing) when it is past the margin and shedding is on."""
        estimate = self._promise(view, now, ahead, num_new_tokens, is_guessed=False)
        self._cheapest[view.request_id] = estimate.run_s
        if self.config.is_unattainable(estimate.own_s, view.slo_s):
            self._alone_late.add(view.request_id)
        return estimate

    def check_arrival(self, request_id: int, arrival_s: float, slo_s: float, now: float,
                      ahead: Sequence[QueuedRequest], size: PromptSize) -> None:
        """Before the request is even tokenized, priced as `admit` prices it with its size guessed
        from its text: `SloUnattainable` past the margin; admitted, its guessed work is promised ahead
        of later arrivals until `admit` prices it exactly, so a burst is refused here in order and
        not only after each request was tokenized."""
        if self.config.is_on:
            view, new_tokens = self.pricer.guessed(request_id, arrival_s, slo_s, size)
            self._promise(view, now, ahead, new_tokens, is_guessed=True)

    def _promise(self, view: QueuedRequest, now: float, ahead: Sequence[QueuedRequest],
                 num_new_tokens: Sequence[int], is_guessed: bool) -> TtftEstimate:
        """Price the request against the work ahead: refused past the margin, else its own work is
        promised ahead of later arrivals (replacing what it promised before)."""
        # a queued request that would be late even started now alone is doomed: the scheduler serves
        # it only when that costs no request still on time, and past saving it is shed unrun, so
        # neither is work ahead of an arrival (counting them refused arrivals that were in time)
        ahead = [r for r in ahead if not self._is_doomed(r, now)]
        estimate = self.pricer.estimate(view, now, ahead, self.busy_s(now, view.request_id), num_new_tokens)
        ratio = self.errors.lateness_ratio
        expected = estimate.scaled(ratio)
        if self._is_late_for_load(expected, view.slo_s):
            raise self._refusal(expected, view.slo_s, is_guessed, ratio)
        self._admitting[view.request_id] = (estimate.prefill_s, estimate.run_s, now)
        return estimate

    def _refusal(self, estimate: TtftEstimate, slo_s: float, is_guessed: bool, ratio: float) -> SloUnattainable:
        retry = retry_after_s(estimate, slo_s, self.config.max_lateness)
        message = late_message(estimate, slo_s, self.config.max_lateness, retry, ratio)
        if is_guessed:
            message += " (its own work sized from its text's length, before tokenizing)"
        return SloUnattainable(message, retry)

    def _is_late_for_load(self, estimate: TtftEstimate, slo_s: float) -> bool:
        """Past the margin, unless no load is to blame: a request whose own cheapest run is past it
        even on an idle server, arriving with nothing ahead, is served (at full reuse, as the
        scheduler serves any request past saving); refusing it would refuse every retry too."""
        if not self.config.is_unattainable(estimate.ttft_s, slo_s):
            return False
        return estimate.start_s > 0 or not self.config.is_unattainable(estimate.own_s, slo_s)

    def start_batch(self, batch: Sequence[QueuedRequest], now: float) -> None:
        """A batch of these requests starts prefilling: its cheapest price is work ahead of every
        arrival until it ends (its budget would count the slack the planner may spend, and a batch
        that ends early would go on counting it)."""
        self.batch_ends_s = now + (self.pricer.cheapest_s(batch) if batch else 0.0)
        self.forget([r.request_id for r in batch])

    def end_batch(self) -> None:
        self.batch_ends_s = 0.0

    def settle(self, request_id: int) -> None:
        """The admission ended (queued, or refused): its documents are stored or never will be."""
        self._admitting.pop(request_id, None)

    def forget(self, request_ids: Sequence[int]) -> None:
        """These requests left the queue (batched, cancelled, refused)."""
        for request_id in request_ids:
            self._cheapest.pop(request_id, None)
            self._alone_late.discard(request_id)

    def expired(self, queue: Sequence[QueuedRequest], now: float) -> list[tuple[QueuedRequest, str]]:
        """Queued requests whose first token, even if their batch started now alone at its cheapest
        plan, would be past the margin, each with the message its client gets."""
        out = []
        for view in self._sheddable(queue):
            estimate = self._alone_now(view, now)
            if self.config.is_unattainable(estimate.ttft_s, view.slo_s):
                out.append((view, f"slo_ms={view.slo_s * 1e3:.0f}: this request waited {estimate.waited_s:.2f} s in "
                                  f"the queue; with its own {estimate.run_s:.2f} s at its cheapest plan its first "
                                  f"token would come past {self.config.max_lateness:g}x its SLO (--shed-late), so "
                                  f"it was not run"))
        return out

    def next_expiry_s(self, queue: Sequence[QueuedRequest], now: float) -> float:
        """The clock time the first of `queue` becomes past saving (`expired`); inf: none will while
        the queue stays as it is."""
        return min((view.arrival_s + self.config.max_lateness * view.slo_s - self._alone_now(view, now).run_s
                    for view in self._sheddable(queue)), default=math.inf)

    def _sheddable(self, queue: Sequence[QueuedRequest]) -> list[QueuedRequest]:
        """The queued requests shedding may answer refused: only while others wait beside them
        (running a late request alone delays no one waiting: later arrivals are priced behind it, and
        its own prefill, already paid, may be what made it late), and none admitted late with nothing
        ahead, which no load caused."""
        if not self.config.is_on or len(queue) < 2:
            return []
        return [view for view in queue if view.request_id not in self._alone_late]

    def _is_doomed(self, view: QueuedRequest, now: float) -> bool:
        """Started now alone at its cheapest plan, its first token would still be past its SLO (the
        scheduler's floor prices more work than that, so the scheduler holds it doomed too)."""
        return view.request_id in self._alone_late or self._alone_now(view, now).ttft_s > view.slo_s

    def _alone_now(self, view: QueuedRequest, now: float) -> TtftEstimate:
        run_s = self._cheapest.get(view.request_id)
        if run_s is None:  # queued without an estimate (submitted to the loop directly)
            run_s = self._cheapest[view.request_id] = self.pricer.cheapest_s([view])
        return TtftEstimate(now - view.arrival_s, 0.0, 0.0, run_s)


def is_full_reuse(plan: str, num_recomputed: int) -> bool:
    """Whether a request ran the plan its estimate priced: full reuse, no warm-up, no probe, no row
    recomputed (`plan`: its batch's label, "" when it never ran)."""
    return bool(plan) and parse_label(plan)[:3] == FULL_REUSE and num_recomputed == 0


class EstimateErrors:
    """How the admitted requests' estimates compared with their measured TTFTs: measured / estimated
    over the latest `window` requests. The estimate prices the cheapest plans, so a ratio near 1
    means the margin refuses what was truly late; well above 1, the work ahead runs slower than its
    price (decoding beside prefill, a busy machine) and the refusals come late.

    `lateness_ratio` is the same ratio over the requests that ran their cheapest plan (full reuse,
    nothing recomputed): for them the estimate priced what really ran, so what is left is what the
    bound leaves out (decode steps between batches, admissions' prefills sharing the cores). The
    others' ratios also hold the recomputation the planner bought with their slack, which the
    server chose and would not have spent on a request with less."""

    def __init__(self, window: int = 512) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._cheapest: deque[float] = deque(maxlen=CHEAPEST_WINDOW)
        self.num_observed = 0
        self._lock = threading.Lock()  # results resolve on the prefill and decode threads

    def observe(self, estimated_s: float, measured_s: float, is_cheapest: bool = False) -> None:
        if estimated_s <= 0:
            return
        ratio = measured_s / estimated_s
        with self._lock:
            self._ratios.append(ratio)
            if is_cheapest:
                self._cheapest.append(ratio)
            self.num_observed += 1

    @property
    def lateness_ratio(self) -> float:
        """Median measured / estimated TTFT of the latest requests served at their cheapest plan,
        within [1, MAX_LATENESS_RATIO]; 1 until MIN_CHEAPEST were. Never below 1: the estimate
        stays a bound, so a refusal still means even the cheapest plan would be late."""
        with self._lock:
            ratios = list(self._cheapest)
        if len(ratios) < MIN_CHEAPEST:
            return 1.0
        return min(max(statistics.median(ratios), 1.0), MAX_LATENESS_RATIO)

    def quantiles(self, qs: Sequence[float] = (0.5, 0.9)) -> dict[str, float]:
        """{"0.5": ratio, ...} over the window; empty before any request was measured."""
        with self._lock:
            ordered = sorted(self._ratios)
        if not ordered:
            return {}
        return {f"{q:g}": ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs}
