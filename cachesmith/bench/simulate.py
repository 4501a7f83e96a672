"""Simulate one bench setting: the real Engine loop, scheduler and planner on a virtual clock that
advances by the cost model's TTFT, with gate verdicts from the outcome tables.

In: an `OutcomeTable`, a `Profile` (this machine's costs), a `BenchConfig` (workload, arrivals,
SLO scales, methods), optionally the base SLO, planner overrides and this machine's pace per plan
family and reuse cost (`bench.pace.MachinePace`). Out: a `BenchResult` (the
bench's rows, BestStatic included, and per-request records), in seconds of simulated time.
Requests take the table's instance with the trace's instance seed when it was measured (so a
simulation of a measured replay serves the very same instances), else one drawn from the task's
measured instances, seeded by the instance seed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cachesmith.bench.metrics import best_static, summarize
from cachesmith.bench.run import BenchResult
from cachesmith.bench.setting import BenchConfig, trace_config
from cachesmith.clock import ReplayClock
from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import ConfigError
from cachesmith.planner import BatchShape, CostModel, PlannerConfig, Profile
from cachesmith.scheduler import QueuedRequest, ScheduleDecision, Scheduler, SchedulerConfig
from cachesmith.bench.sim_executor import MachineNoise, SimExecutor
from cachesmith.bench.outcomes import Outcome, OutcomeTable
from cachesmith.bench.pace import MachinePace
from cachesmith.workloads.trace import make_trace


MAX_DECISION_S = 1.0  # a pinned decision time past this is a unit slip (ms given as s), not a machine


@dataclass
class FixedDecisionTime:
    """A scheduler whose decisions cost `decision_s` of virtual time, not their measured wall time:
    with the planner's decisions fixed too (`SimExecutor`), a simulated run repeats exactly."""
    inner: Scheduler
    decision_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.decision_s <= MAX_DECISION_S:
            raise ConfigError(f"decision_s={self.decision_s} must be in [0, {MAX_DECISION_S}] seconds")

    def next_batch(self, queue: list[QueuedRequest], now: float) -> ScheduleDecision | None:
        decision = self.inner.next_batch(queue, now)
        return None if decision is None else replace(decision, decision_s=self.decision_s)


def instance_for(table: OutcomeTable, task: str, instance_seed: int) -> Outcome:
    pool = table.by_task(task)
    for o in pool:
        if o.seed == instance_seed:
            return o
    return pool[int(np.random.default_rng(instance_seed).integers(len(pool)))]


def base_slo(table: OutcomeTable, profile: Profile, bandwidth_gbps: float | None = None) -> float:
    """Mean single-request full-prefill TTFT over every measured instance (the task mix)."""
    cost = CostModel(profile, bandwidth_gbps)
    return float(np.mean([cost.full_prefill_ttft(BatchShape((o.context_tokens,), (o.suffix_tokens,),
                                                             (o.prefix_tokens,))) for o in table.outcomes]))


def simulate_run(table: OutcomeTable, profile: Profile, config: BenchConfig, base_slo_s: float, method: str,
                 slo_scale: float, planner: PlannerConfig | None = None, pool: list[Outcome] | None = None,
                 machine: MachinePace | dict | None = None, machine_profile: Profile | None = None,
                 noise: MachineNoise | None = None, decision_s: float | None = None) -> tuple[list[dict], object]:
    """(records, engine stats) of one (method, SLO scale) run. `pool`: request i serves pool[i % len]
    (a workload file's lines, as the replay bench cycles them) instead of the task's instances.
    `noise`: the machine's pace wanders batch to batch (`MachineNoise`); None: it holds steady.
    `decision_s`: every scheduling and plan decision costs this much virtual time, so the run
    repeats exactly; None: their measured wall time."""
    if config.gate != "task":
        raise ConfigError(f"gate={config.gate!r}: the outcome tables hold task-gate verdicts only")
    table.check_measured(method, pool or table.by_task(config.task))
    planner = replace(planner or PlannerConfig(), bandwidth_gbps=config.bandwidth_gbps)
    sched = SchedulerConfig(max_batch_size=config.max_batch_size, kv_capacity_tokens=config.kv_capacity_tokens)
    link = CostModel(machine_profile or profile, config.bandwidth_gbps)
    engine = Engine(None, profile, EngineConfig(method, "replay", config.gate, sched, planner), ReplayClock(),
                    runtime=lambda p: SimExecutor(table, p, link, machine, noise, decision_s))
    if decision_s is not None:
        engine.scheduler = FixedDecisionTime(engine.scheduler, decision_s)
    trace = make_trace(trace_config(config, base_slo_s, slo_scale))
    requests = [engine.executor.request(r.request_id, pool[r.request_id % len(pool)] if pool else
                                        instance_for(table, config.task, r.instance_seed), r.slo_s, r.arrival_s)
                for r in trace.requests]
    results = engine.run(requests)
    records = [{**r.to_dict(), "method": method, "slo_scale": slo_scale} for r in results]
    return records, engine.stats


def simulate(table: OutcomeTable, profile: Profile, config: BenchConfig, base_slo_s: float | None = None,
             planner: PlannerConfig | None = None, pool: list[Outcome] | None = None,
             machine: MachinePace | dict | None = None, machine_profile: Profile | None = None) -> BenchResult:
    base = base_slo_s or base_slo(table, profile, config.bandwidth_gbps)
    rows, records = [], []
    for scale in config.slo_scales:
        for method in config.methods:
            recs, stats = simulate_run(table, profile, config, base, method, scale, planner, pool, machine, machine_profile)
            rows.append(summarize(method, scale, recs, stats))
            records += recs
    return BenchResult(config, base, 1.0, "simulated", rows + best_static(rows), records)
