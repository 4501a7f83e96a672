"""The SLO-aware scheduler (paper §5.2, Algorithm 1): at each batch boundary, pick the batch and
its budget that let the most requests of the whole queue meet their SLO inside their budget band.

In: the queue of `QueuedRequest`s, the current time and a `Planner` (for budget bands; it never
touches tensors). Out: a `ScheduleDecision`. Requests that cannot meet their SLO are "doomed"
(infeasible at margin 1, `scheduler.feasibility`). They, and those that only full reuse can still
serve in time (their budget band's floor alone ends past their deadline), are held apart and served
at full reuse when that costs no one else, in batches that end before the next arrival is predicted.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner
from cachesmith.planner.grid import TERMS, request_terms, ttft_grid, ttft_totals
from cachesmith.recompute import full_reuse
from cachesmith.scheduler.arrivals import ArrivalHistory
from cachesmith.scheduler.buckets import bucketize, compositions
from cachesmith.scheduler.feasibility import DeadlinePricer, infeasible
from cachesmith.scheduler.types import QueuedRequest, ScheduleDecision, batch_shape


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 16
    max_candidates: int = 256  # compositions evaluated per decision
    kv_capacity_tokens: int = 65_536  # tokens whose KV (all layers) fits resident at once
    length_edges: tuple[int, ...] = (1024, 2048, 4096)
    band_signal: str = "kv_dev"  # bands are needed before layer 0 has picked the signal
    is_partial_allocation: bool = True  # in a burst, hold a window of layers per request
    window_layers: int | None = None  # None: the deepest rank depth the planner profiles, + 1
    # budgets aim this fraction of the time to the deadline early: execution noise under the
    # runtime monitor's tolerance would otherwise turn a budget set at the deadline into a miss
    safety_margin: float = 0.08
    # past saturation, leave the predicted next arrival room for its own saturation budget
    is_arrival_aware: bool = True
    arrival_window: int = 64  # recent arrivals the prediction is measured on
    # a batch whose budget the waiting queue bounds takes only its share of the room (`_shared_room`)
    is_slack_shared: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_candidates < 1 or self.kv_capacity_tokens < 1:
            raise ConfigError("max_batch_size, max_candidates and kv_capacity_tokens must be >= 1")
        if not 0 <= self.safety_margin < 0.5:
            raise ConfigError(f"safety_margin={self.safety_margin} must be in [0, 0.5)")
        if self.window_layers is not None and self.window_layers < 1:
            raise ConfigError(f"window_layers={self.window_layers} must be >= 1")
        if self.arrival_window < 8:
            raise ConfigError(f"arrival_window={self.arrival_window} must be >= 8")


class SloAwareScheduler:
    def __init__(self, planner: Planner, config: SchedulerConfig | None = None) -> None:
        self.planner = planner
        self.config = config or SchedulerConfig()
        num_layers = planner.profile.num_layers
        # a QCI probe rewinds to the last WarmUp layer: the window must span the deepest probe
        deepest = max(planner.depths) + 1
        self.window_layers = min(num_layers, max(self.config.window_layers or deepest, deepest))
        self.partial_capacity = self.config.kv_capacity_tokens * num_layers // self.window_layers
        self.arrivals = ArrivalHistory(max_requests=self.config.arrival_window)
        self.pricer = DeadlinePricer(planner, self.config.max_batch_size)  # prices feasibility

    def band(self, requests: Sequence[QueuedRequest]) -> tuple[float, float]:
        """(floor, saturation) of running `requests` as one batch."""
        floor, saturation = self._bands_of(_terms(requests).sum(0)[None, :])
        return float(floor[0]), float(saturation[0])

    def floor(self, r: QueuedRequest) -> float:
        return self.band([r])[0]

    def floors(self, requests: Sequence[QueuedRequest]) -> np.ndarray:
        """[R] each request's floor alone, in one walk of the cost model."""
        return self._bands_of(_terms(requests))[0]

    def full_reuse_s(self, requests: Sequence[QueuedRequest]) -> tuple[float, float]:
        """(TTFT of full reuse, the coverage that fits in it for free while KV streams in)."""
        grid = np.round(np.arange(0, 21) * 0.05, 2)
        t = ttft_grid(self.planner.cost, batch_shape(requests), "position", ((0, 0),), grid)[0]
        free = grid[t <= t[0] * (1 + 1e-9)]
        return float(t[0]), float(free.max())

    def next_batch(self, queue: Sequence[QueuedRequest], now: float) -> ScheduleDecision | None:
        start = time.perf_counter()
        if not queue:
            return None
        floor_s, saturation_s = self._bands_of(_terms(queue))  # [R] each alone, one walk for both
        self._observe(queue, saturation_s)
        floors = dict(zip((r.request_id for r in queue), floor_s.tolist()))
        spans = dict(zip((r.request_id for r in queue), np.maximum(saturation_s - floor_s, 0.0).tolist()))
        doomed_ids = {v.request.request_id for v in infeasible(self.pricer, queue, now, margin=1.0)}
        # the doomed, and those only full reuse can still serve in time (their band's floor is too late)
        reused = doomed_ids | {r.request_id for r in queue if now + floors[r.request_id] > r.deadline_s}
        doomed = [r for r in queue if r.request_id in reused]
        live = [r for r in queue if r.request_id not in reused]
        gap = self._next_gap(now)
        if not live:
            return self._doomed_batch(doomed, self._doomed_members(doomed, gap), doomed_ids, start)
        priced = self._price(live, floors, now, spans)
        best, window = self._pick(priced, self.config.kv_capacity_tokens), None
        if self._is_burst(priced[0]):
            # a bucket that cannot run at once: hold a window of layers per request and widen
            wide = self._pick(priced, self.partial_capacity)
            if wide[0] > best[0]:  # only when it places more requests on time
                best, window = wide, self.window_layers
        if doomed:  # serve the doomed first only if no live request loses its chance by it
            members = self._doomed_members(doomed, gap)
            later = self._pick(self._price(live, floors, now + members[1], spans), self.config.kv_capacity_tokens)
            if later[0] >= best[0]:
                return self._doomed_batch(doomed, members, doomed_ids, start)
        on_time, batch, budget, limit = best
        num_candidates = len(priced[1]) - 1  # the fallback row is not one
        return ScheduleDecision(tuple(r.request_id for r in batch), budget, "planned", limit_s=limit,
                                expected_on_time=on_time, num_candidates=num_candidates,
                                decision_s=time.perf_counter() - start,
                                doomed_ids=tuple(sorted(doomed_ids)), kv_window_layers=window)

    def _observe(self, queue: Sequence[QueuedRequest], saturation_s: np.ndarray) -> None:
        for r, s in zip(queue, saturation_s.tolist()):
            self.arrivals.observe(r.request_id, r.arrival_s, r.slo_s, s)  # the first sighting counts

    def _next_gap(self, now: float) -> float:
        """Seconds to the predicted next arrival; inf when nothing is predicted."""
        return self.arrivals.next_gap(now) if self.config.is_arrival_aware else float("inf")

    def _arrival_room(self, now: float, queued_work: np.ndarray) -> np.ndarray:
        """[M] the most budget a batch may take past saturation and still leave the predicted next
        arrival, behind the batch and the waiting queue at floors, its own saturation budget before
        its deadline; inf when nothing is predicted."""
        gap = self._next_gap(now)
        if not np.isfinite(gap):
            return np.full(queued_work.shape, np.inf)
        slo, saturation = self.arrivals.typical()
        return gap + slo - saturation - queued_work

    def _is_burst(self, buckets: list[list[QueuedRequest]]) -> bool:
        """Some deadline x length bucket holds more context than the KV capacity (paper §5.2)."""
        if not self.config.is_partial_allocation or self.window_layers >= self.planner.profile.num_layers:
            return False
        return any(sum(r.num_tokens for r in b) > self.config.kv_capacity_tokens for b in buckets)

    def _doomed_members(self, doomed: list[QueuedRequest], gap: float) -> tuple[list[QueuedRequest], float, float]:
        """The doomed batch with its full reuse (TTFT, free coverage): the earliest arrivals, as many
        as end before the predicted next arrival `gap` seconds away (at least one). A batch runs to its end once started, so a long doomed batch makes every
        request arriving meanwhile wait behind work that is late anyway; under sustained overload
        that wait turns the next arrivals doomed in turn."""
        ordered = sorted(doomed, key=lambda r: r.arrival_s)[: self.config.max_batch_size]
        size = len(ordered) if not np.isfinite(gap) else 1
        priced = self.full_reuse_s(ordered[:size])
        while size < len(ordered):  # one walk per size tried, the first that ends too late the last
            wider = self.full_reuse_s(ordered[: size + 1])
            if wider[0] > gap:
                break
            size, priced = size + 1, wider
        return ordered[:size], *priced

    def _doomed_batch(self, doomed: list[QueuedRequest], members: tuple[list[QueuedRequest], float, float],
                      doomed_ids: set[int], start: float) -> ScheduleDecision:
        """`members` at full reuse; `doomed_ids`: which of the rest are reported doomed (infeasible)."""
        batch, ttft, coverage = members
        return ScheduleDecision(tuple(r.request_id for r in batch), ttft, "full_reuse", full_reuse(), coverage,
                                decision_s=time.perf_counter() - start,
                                doomed_ids=tuple(r.request_id for r in doomed if r not in batch and r.request_id in doomed_ids))

    def _price(self, live: list[QueuedRequest], floors: dict[int, float], now: float,
               spans: dict[int, float] | None = None):
        """Every candidate composition priced in one vectorized pass: (buckets, compositions [M, B]
        with the most urgent request alone as the last row, on-time counts, budgets, tokens).
        `spans`: each request's band span alone (saturation less floor); None shares no room."""
        cfg = self.config
        quantum = max(min(floors[r.request_id] for r in live), 1e-3)
        buckets = bucketize(live, now, quantum, cfg.length_edges)
        alone = np.zeros((1, len(buckets)), int)
        alone[0, 0] = 1  # the fallback when nothing fits the KV capacity together
        combos = np.vstack([np.array(list(compositions([len(b) for b in buckets], cfg.max_batch_size,
                                                        cfg.max_candidates))), alone])
        return (buckets, combos, *self._evaluate(buckets, combos, floors, spans, now))

    def _pick(self, priced, capacity: int) -> tuple[int, list[QueuedRequest], float, float]:
        """(on time, members, budget, limit) of the first composition within `capacity` that
        satisfies every live request, else the one that satisfies the most."""
        buckets, combos, score, budget, hard, tokens = priced
        fits = tokens[:-1] <= capacity
        score = np.append(np.where(fits, score[:-1], -1), score[-1] if not fits.any() else -1)
        done = np.nonzero(score == sum(len(b) for b in buckets))[0]
        m = int(done[0]) if done.size else int(np.argmax(score))
        return (int(score[m]), [r for b, k in zip(buckets, combos[m]) for r in b[:k]], float(budget[m]),
                float(hard[m]))

    def _evaluate(self, buckets: list[list[QueuedRequest]], combos: np.ndarray, floors: dict[int, float],
                  spans: dict[int, float] | None, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(requests on time in batch + modeled queue, budget, limit, context tokens) per candidate.

        A candidate's budget rises toward its most urgent member's deadline, capped at saturation
        and where a waiting request that makes its deadline at its floor behind the batch (the
        queue FCFS at floors) would miss it, of which room it takes its share (`_shared_room`);
        past saturation only while the whole waiting queue still clears its floor and the predicted
        next arrival keeps its saturation budget. Below its floor it runs at the floor and counts who
        still makes it. The limit is the latest end that costs no member, and no waiting request
        that makes it, its deadline: the runtime monitor may let a late batch run into the gap
        between budget and limit rather than cut its coverage."""
        totals, tokens, first_deadline = _compose(buckets, combos)
        floor, saturation = self._bands_of(totals)
        limit = (first_deadline - now) * (1.0 - self.config.safety_margin)
        waiting, fl, dl, span = _waiting_queue(buckets, combos, floors, spans or {})  # [M, Q], [Q], [Q], [Q]
        queue_ends = np.cumsum(waiting * fl[None, :], 1)  # [M, Q] after the batch starts the queue
        makes_it = waiting & (now + floor[:, None] + queue_ends <= dl[None, :])  # [M, Q]
        slack = np.where(makes_it, dl[None, :] - queue_ends - now - 1e-9, np.inf)  # [M, Q], off the rounding edge
        room = slack.min(1)  # [M]
        is_shared = self.config.is_slack_shared and spans is not None
        shared = _shared_room(floor, saturation, room, slack, span) if is_shared else room
        budget = np.where(floor > limit, floor, np.maximum(floor, np.minimum(np.minimum(limit, saturation), shared)))
        queued = (((now + budget)[:, None] + queue_ends <= dl[None, :]) & waiting).sum(1)
        raise_ok = (floor <= limit) & (limit > saturation) & (queued == waiting.sum(1)) & (room >= limit)
        if raise_ok.any():
            raised = np.minimum(limit, self._arrival_room(now, queue_ends[:, -1]))
            budget = np.where(raise_ok, np.maximum(budget, raised), budget)
        hard = np.maximum(budget, np.minimum(first_deadline - now, room))
        return _members_on_time(buckets, combos, now + budget) + queued, budget, hard, tokens

    def _bands_of(self, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Budget bands [M] of M batches given by their summed request terms [M, 8], in one walk."""
        cfg, cost, signal = self.planner.config, self.planner.cost, self.config.band_signal
        M = totals.shape[0]
        # measured / predicted of (S, 1, 1) batches of each candidate's size, learned while serving
        k = self.planner.paces.paces(signal, 1, totals[:, 0])  # [M]
        t = ttft_totals(cost, signal, ((1, 1),), np.repeat([cfg.r_min, cfg.r_max], M), np.vstack([totals, totals]))[0]
        return k * t[:M], k * t[M:]


def _compose(buckets: list[list[QueuedRequest]], combos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate [M]: summed cost-model terms [M, 9], context tokens, most urgent deadline
    (each bucket's first k members, sorted by deadline)."""
    M = combos.shape[0]
    totals, tokens, first_deadline = np.zeros((M, len(TERMS))), np.zeros(M), np.full(M, np.inf)
    flat = [r for bucket in buckets for r in bucket]
    terms, sizes = _terms(flat), np.array([r.num_tokens for r in flat], float)  # one call for all
    ends = np.cumsum([len(bucket) for bucket in buckets])
    for b, bucket in enumerate(buckets):
        k, rows = combos[:, b], slice(ends[b] - len(bucket), ends[b])
        totals += np.vstack([np.zeros(len(TERMS)), np.cumsum(terms[rows], 0)])[k]
        tokens += np.concatenate([[0.0], np.cumsum(sizes[rows])])[k]
        first_deadline = np.where(k > 0, np.minimum(first_deadline, bucket[0].deadline_s), first_deadline)
    return totals, tokens, first_deadline


def _shared_room(floor: np.ndarray, saturation: np.ndarray, room: np.ndarray, slack: np.ndarray,
                 span: np.ndarray) -> np.ndarray:
    """[M] the part of the room before the binding waiting request that a candidate may take: the
    room past its floor is split between the batch and the waiting requests up to the binding one,
    in proportion to the time each can still turn into coverage (saturation less floor). Pass
    probability is concave in coverage (steep to ~15%, flat after), so one batch taking the whole
    room while those behind it fall to their floors passes fewer requests than an even split."""
    binding = slack.argmin(1)  # [M]; where nothing binds (room inf) the result is inf below anyway
    ahead = np.isfinite(slack) & (np.arange(slack.shape[1])[None, :] <= binding[:, None])  # [M, Q]
    own = np.maximum(saturation - floor, 0.0)
    others = (ahead * span[None, :]).sum(1)
    share = np.divide(own, own + others, out=np.ones_like(own), where=own + others > 0)
    return np.where(np.isfinite(room), floor + share * np.maximum(room - floor, 0.0), np.inf)


def _waiting_queue(buckets: list[list[QueuedRequest]], combos: np.ndarray, floors: dict[int, float],
                   spans: dict[int, float]):
    """The queue in arrival order: which requests wait behind each candidate [M, Q], their floors
    [Q], deadlines [Q] and bands' spans (saturation less floor) [Q]."""
    order = sorted(((r.arrival_s, b, j) for b, bucket in enumerate(buckets) for j, r in enumerate(bucket)))
    where_b = np.array([b for _, b, _ in order])
    where_j = np.array([j for _, _, j in order])
    waiting = combos[:, where_b] <= where_j[None, :]  # [M, Q]
    fl = np.array([floors[buckets[b][j].request_id] for _, b, j in order])
    dl = np.array([buckets[b][j].deadline_s for _, b, j in order])
    span = np.array([spans.get(buckets[b][j].request_id, 0.0) for _, b, j in order])
    return waiting, fl, dl, span


def _members_on_time(buckets: list[list[QueuedRequest]], combos: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[M] members whose deadline the batch's end meets (members sorted by deadline per bucket)."""
    on_time = np.zeros(combos.shape[0], int)
    for b, bucket in enumerate(buckets):
        deadlines = np.array([r.deadline_s for r in bucket])
        on_time += combos[:, b] - np.minimum(combos[:, b], np.searchsorted(deadlines, ends, "left"))
    return on_time


def _terms(requests: Sequence[QueuedRequest]) -> np.ndarray:
    """[R, 9] cost-model terms of the requests (`planner.grid.TERMS`)."""
    return request_terms([r.context_tokens for r in requests], [r.suffix_tokens for r in requests],
                         [r.prefix_tokens for r in requests])
