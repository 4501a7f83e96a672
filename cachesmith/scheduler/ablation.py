"""The component ablation's schedulers (paper §6.3, Fig. 11): CacheSmith's planner without its
scheduler, then with SLO-derived budgets, before the full scheduler adds out-of-order compositions
and partial KV allocation.

- `FcfsPlanned` ("planner alone"): batches in arrival order; the planner decides (S, w, p, r)
  under a fixed budget, the baseline preset's own TTFT for the same batch.
- `FcfsSloBudget` ("+SLO"): batches in arrival order; the budget comes from the deadlines of the
  whole queue: the largest in the batch's band that keeps the most requests on time, the waiting
  ones modeled FCFS at their floors behind it.
In: the queue, the current time. Out: a "planned" `ScheduleDecision`. Never touches tensors.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cachesmith.planner import Planner
from cachesmith.scheduler.fcfs import FcfsStatic, arrival_batch
from cachesmith.scheduler.slo_aware import SchedulerConfig, SloAwareScheduler
from cachesmith.scheduler.types import QueuedRequest, ScheduleDecision

NUM_BUDGET_LEVELS = 16  # budgets tried between the batch's floor and its cap


class FcfsPlanned(FcfsStatic):
    def decide(self, batch: Sequence[QueuedRequest]) -> ScheduleDecision:
        """The same batch and budget as the preset's; the planner decides the plan."""
        return ScheduleDecision(tuple(r.request_id for r in batch), self.ttft(batch, self.plan), "planned")


class FcfsSloBudget:
    def __init__(self, planner: Planner, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.bands = SloAwareScheduler(planner, replace(self.config, is_partial_allocation=False))

    def next_batch(self, queue: Sequence[QueuedRequest], now: float) -> ScheduleDecision | None:
        start = time.perf_counter()
        if not queue:
            return None
        batch = arrival_batch(queue, self.config)
        members = {r.request_id for r in batch}
        waiting = sorted((r for r in queue if r.request_id not in members), key=lambda r: r.arrival_s)
        floor, saturation = self.bands.band(batch)
        limit = (min(r.deadline_s for r in batch) - now) * (1.0 - self.config.safety_margin)
        budgets = np.linspace(floor, max(floor, min(limit, saturation)), NUM_BUDGET_LEVELS)  # [K]
        deadlines = np.array([r.deadline_s for r in batch])
        on_time = (now + budgets[:, None] <= deadlines[None, :]).sum(1)
        if waiting:
            floors = np.cumsum(self.bands.floors(waiting))  # FCFS at floors after the batch
            wait_deadlines = np.array([r.deadline_s for r in waiting])
            on_time += (now + budgets[:, None] + floors[None, :] <= wait_deadlines[None, :]).sum(1)
        k = len(budgets) - 1 - int(np.argmax(on_time[::-1]))  # the most on time; ties: the larger budget
        return ScheduleDecision(tuple(r.request_id for r in batch), float(budgets[k]), "planned",
                                expected_on_time=int(on_time[k]), decision_s=time.perf_counter() - start)
