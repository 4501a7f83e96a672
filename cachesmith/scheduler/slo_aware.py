"""The SLO-aware scheduler (paper §5.2, Algorithm 1): at each batch boundary, pick the batch and
its budget that let the most requests of the whole queue meet their SLO inside their budget band.

In: the queue of `QueuedRequest`s, the current time and a `Planner` (for budget bands; it never
touches tensors). Out: a `ScheduleDecision`. Requests that cannot meet their SLO even at their
floor alone are "doomed": held apart and served at full reuse when that costs no one else.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.planner import BatchShape, Planner
from cachesmith.planner.grid import ttft_grid
from cachesmith.recompute import full_reuse
from cachesmith.scheduler.buckets import bucketize, compositions
from cachesmith.scheduler.types import QueuedRequest, ScheduleDecision


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 16
    max_candidates: int = 256  # compositions evaluated per decision
    kv_capacity_tokens: int = 65_536  # tokens whose KV fits at once (partial allocation: #7 engine)
    length_edges: tuple[int, ...] = (1024, 2048, 4096)
    band_signal: str = "kv_dev"  # bands are needed before layer 0 has picked the signal

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_candidates < 1 or self.kv_capacity_tokens < 1:
            raise ConfigError("max_batch_size, max_candidates and kv_capacity_tokens must be >= 1")


def _shape(requests: Sequence[QueuedRequest]) -> BatchShape:
    return BatchShape(tuple(r.context_tokens for r in requests), tuple(r.suffix_tokens for r in requests),
                      tuple(r.prefix_tokens for r in requests))


class SloAwareScheduler:
    def __init__(self, planner: Planner, config: SchedulerConfig | None = None) -> None:
        self.planner = planner
        self.config = config or SchedulerConfig()
        self._bands: dict[tuple, tuple[float, float]] = {}  # by the batch's sorted token counts

    def band(self, requests: Sequence[QueuedRequest]) -> tuple[float, float]:
        key = tuple(sorted((r.context_tokens, r.suffix_tokens, r.prefix_tokens) for r in requests))
        if key not in self._bands:
            if len(self._bands) > 100_000:
                self._bands.clear()
            self._bands[key] = self.planner.band(_shape(requests), self.config.band_signal)
        return self._bands[key]

    def floor(self, r: QueuedRequest) -> float:
        return self.band([r])[0]

    def full_reuse_s(self, requests: Sequence[QueuedRequest]) -> tuple[float, float]:
        """(TTFT of full reuse, the coverage that fits in it for free while KV streams in)."""
        grid = np.round(np.arange(0, 21) * 0.05, 2)
        t = ttft_grid(self.planner.cost, _shape(requests), "position", ((0, 0),), grid)[0]
        free = grid[t <= t[0] * (1 + 1e-9)]
        return float(t[0]), float(free.max())

    def next_batch(self, queue: Sequence[QueuedRequest], now: float) -> ScheduleDecision | None:
        start = time.perf_counter()
        if not queue:
            return None
        floors = {r.request_id: self.floor(r) for r in queue}
        doomed = [r for r in queue if now + floors[r.request_id] > r.deadline_s]
        live = [r for r in queue if now + floors[r.request_id] <= r.deadline_s]
        if not live:
            return self._doomed_batch(doomed, now, start)
        best = self._search(live, floors, now)
        if doomed:  # serve the doomed first only if no live request loses its chance by it
            wait, _ = self.full_reuse_s(doomed[: self.config.max_batch_size])
            if self._search(live, floors, now + wait)[0] >= best[0]:
                return self._doomed_batch(doomed, now, start)
        on_time, members, budget, count = best
        return ScheduleDecision(tuple(r.request_id for r in members), budget, "planned",
                                expected_on_time=on_time, num_candidates=count,
                                decision_s=time.perf_counter() - start,
                                doomed_ids=tuple(r.request_id for r in doomed))

    def _doomed_batch(self, doomed: list[QueuedRequest], now: float, start: float) -> ScheduleDecision:
        batch = sorted(doomed, key=lambda r: r.arrival_s)[: self.config.max_batch_size]
        ttft, coverage = self.full_reuse_s(batch)
        return ScheduleDecision(tuple(r.request_id for r in batch), ttft, "full_reuse", full_reuse(), coverage,
                                decision_s=time.perf_counter() - start,
                                doomed_ids=tuple(r.request_id for r in doomed if r not in batch))

    def _search(self, live: list[QueuedRequest], floors: dict[int, float], now: float):
        """(on time, members, budget, candidates evaluated) of the best composition."""
        cfg = self.config
        quantum = max(min(floors[r.request_id] for r in live), 1e-3)
        buckets = bucketize(live, now, quantum, cfg.length_edges)
        best, count = None, 0
        for combo in compositions([len(b) for b in buckets], cfg.max_batch_size, cfg.max_candidates):
            members = [r for b, k in zip(buckets, combo) for r in b[:k]]
            if sum(r.num_tokens for r in members) > cfg.kv_capacity_tokens:
                continue
            count += 1
            on_time, budget = self._score(members, live, floors, now)
            if best is None or on_time > best[0]:
                best = (on_time, members, budget, count)
            if on_time == len(live):
                break
        if best is None:  # nothing fits the KV capacity together: the most urgent alone
            members = [buckets[0][0]]
            on_time, budget = self._score(members, live, floors, now)
            best = (on_time, members, budget, count)
        return (best[0], best[1], best[2], count)

    def _score(self, members: list[QueuedRequest], live: list[QueuedRequest], floors: dict[int, float],
               now: float) -> tuple[int, float]:
        floor, saturation = self.band(members)
        limit = min(r.deadline_s for r in members) - now
        if floor > limit:  # someone misses anyway: run at the floor, count who still makes it
            budget = floor
        else:
            budget = min(limit, saturation)
        ids = {r.request_id for r in members}
        waiting = sorted((r for r in live if r.request_id not in ids), key=lambda r: r.arrival_s)
        on_time = sum(now + budget <= r.deadline_s for r in members)
        queue_on_time = self._fcfs_at_floors(waiting, floors, now + budget)
        if floor <= limit and limit > saturation and queue_on_time == len(waiting):
            # past saturation only while every waiting request still clears its floor
            if self._fcfs_at_floors(waiting, floors, now + limit) == len(waiting):
                budget = limit
        return on_time + queue_on_time, budget

    @staticmethod
    def _fcfs_at_floors(waiting: list[QueuedRequest], floors: dict[int, float], t: float) -> int:
        on_time = 0
        for r in waiting:
            t += floors[r.request_id]
            on_time += t <= r.deadline_s
        return on_time
