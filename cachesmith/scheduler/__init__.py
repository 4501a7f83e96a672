"""Schedulers: pick the next batch and its latency budget from the queue (paper §5.2), plus the
FCFS baselines. They see token counts and deadlines only, never tensors."""
from typing import Protocol

from cachesmith.scheduler.ablation import FcfsPlanned, FcfsSloBudget
from cachesmith.scheduler.fcfs import FcfsQueueAware, FcfsStatic
from cachesmith.scheduler.slo_aware import SchedulerConfig, SloAwareScheduler
from cachesmith.scheduler.types import QueuedRequest, ScheduleDecision


class Scheduler(Protocol):
    def next_batch(self, queue: list[QueuedRequest], now: float) -> ScheduleDecision | None: ...


__all__ = ["FcfsPlanned", "FcfsQueueAware", "FcfsSloBudget", "FcfsStatic", "QueuedRequest", "ScheduleDecision",
           "Scheduler", "SchedulerConfig", "SloAwareScheduler"]
