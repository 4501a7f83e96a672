"""FCFS baselines (paper §6): batches in arrival order under one static preset, and the
queue-aware variant that sends requests already past saving to full reuse.

In: the queue, the current time. Out: a `ScheduleDecision` with a static plan.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from cachesmith.planner import CostModel
from cachesmith.recompute import RecomputeConfig, full_reuse
from cachesmith.scheduler.slo_aware import SchedulerConfig
from cachesmith.scheduler.types import QueuedRequest, ScheduleDecision, batch_shape


def arrival_batch(queue: Sequence[QueuedRequest], config: SchedulerConfig) -> list[QueuedRequest]:
    """The oldest requests, up to the batch size and the KV capacity (the first one always)."""
    batch, tokens = [], 0
    for r in sorted(queue, key=lambda r: r.arrival_s):
        if len(batch) == config.max_batch_size or (batch and tokens + r.num_tokens > config.kv_capacity_tokens):
            break
        batch.append(r)
        tokens += r.num_tokens
    return batch


class FcfsStatic:
    def __init__(self, plan: RecomputeConfig, cost: CostModel, config: SchedulerConfig | None = None) -> None:
        self.plan, self.cost = plan, cost
        self.config = config or SchedulerConfig()

    def ttft(self, batch: Sequence[QueuedRequest], plan: RecomputeConfig) -> float:
        cov = [plan.coverage] * len(batch)
        return float(self.cost.ttft(batch_shape(batch), plan.signal.value, plan.warmup, plan.probe, cov)[0])

    def next_batch(self, queue: Sequence[QueuedRequest], now: float) -> ScheduleDecision | None:
        start = time.perf_counter()
        if not queue:
            return None
        decision = self.decide(arrival_batch(queue, self.config))
        return replace(decision, decision_s=time.perf_counter() - start)

    def decide(self, batch: Sequence[QueuedRequest]) -> ScheduleDecision:
        """The arrival-order batch under the preset, its budget the preset's own TTFT."""
        return ScheduleDecision(tuple(r.request_id for r in batch), self.ttft(batch, self.plan), "static",
                                self.plan, self.plan.coverage)


class FcfsQueueAware(FcfsStatic):
    """Requests that cannot meet their SLO under the preset, even alone, run at full reuse (in
    their own batch, first) so they drain quickly instead of taking compute from the rest."""

    def next_batch(self, queue: Sequence[QueuedRequest], now: float) -> ScheduleDecision | None:
        start = time.perf_counter()
        if not queue:
            return None
        doomed = [r for r in queue if now + self.ttft([r], self.plan) > r.deadline_s]
        if doomed:
            batch = arrival_batch(doomed, self.config)
            plan = full_reuse()
            return ScheduleDecision(tuple(r.request_id for r in batch), self.ttft(batch, plan), "full_reuse",
                                    plan, 0.0, decision_s=time.perf_counter() - start)
        return super().next_batch(queue, now)
