"""Runs one scheduled batch on the model: the runtime side of the serving loop (paper §5.3).

In: a `ScheduleDecision` and the `Admitted` requests it names (their stored chunk keys and token
counts). Out: a `BatchExecution`: the measured batch TTFT (staging, transfer waits, layer 0, the
plan decided after it, the recompute, the first tokens), transfer stall, the plan, and per request
its first-token logits turned into a greedy answer (decoding runs after the clock stops).
"planned" batches ask the planner for (S, w, p, r) after layer 0, from the layer-0 QCI entropies,
under the decision's budget, and run with the runtime monitor; "static" and "full_reuse" batches
run the decision's plan. Never touches queues.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cachesmith.kvstore import KeyedRequest
from cachesmith.model import greedy_decode
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchPlan, Planner, PlanRequest
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.recompute import HookChain, RecomputeConfig, Signal
from cachesmith.request import Request
from cachesmith.scheduler import QueuedRequest, ScheduleDecision
from cachesmith.scheduler.types import batch_shape

# stages nothing beyond layer 0: the real plan (and what it loads) is decided there
PROVISIONAL = RecomputeConfig(Signal.POSITION, 1, 0, 0.0)


@dataclass(frozen=True)
class Admitted:
    """A request ready to run: chunk KV stored, prompt tokenized, token counts known."""
    request: Request
    keyed: KeyedRequest
    queued: QueuedRequest


@dataclass(frozen=True)
class RequestOutput:
    answer: str
    coverage: float
    num_context_tokens: int
    num_recomputed: int
    qci_entropy: float | None


@dataclass(frozen=True)
class BatchExecution:
    outputs: list[RequestOutput]
    seconds: float  # staging to the last first token: the batch's TTFT
    stall_s: float  # time the runner waited on KV transfer
    plan_label: str
    plan: BatchPlan | None = None  # "planned" batches
    num_monitor_replans: int = 0

    @property
    def planner_s(self) -> float:
        """The planner's decision time (inside `seconds`; staging the plan is not in it)."""
        return self.plan.decision_s if self.plan else 0.0


class BatchExecutor:
    def __init__(self, pipeline: RagPipeline, planner: Planner | None = None) -> None:
        self.pipeline, self.planner = pipeline, planner

    def execute(self, decision: ScheduleDecision, batch: list[Admitted]) -> BatchExecution:
        if decision.mode != "planned":
            plan = replace(decision.static_plan, coverage=decision.coverage)
            outs, seconds, stall = self._timed_run(batch, plan)
            return self._decode(batch, outs, [decision.coverage] * len(batch), seconds, stall, plan.label())
        if self.planner is None:
            raise ValueError("a planned batch needs the executor's planner")
        decided: dict = {}
        outs, seconds, stall = self._timed_run(batch, PROVISIONAL, self._replanner(decision, batch, decided))
        plan, monitor = decided["plan"], decided["monitor"]
        if monitor.pace is not None:  # pace is relative to the corrected schedule
            self.planner.observe(plan.signal, monitor.time_scale * monitor.pace)
        return self._decode(batch, outs, plan.coverages, seconds, stall, plan.recompute_config().label(), plan,
                            monitor.num_replans)

    def _timed_run(self, batch: list[Admitted], plan: RecomputeConfig, replanner=None):
        """(outputs, seconds from staging to the first tokens, transfer stall seconds)."""
        start = time.perf_counter()
        with self.pipeline.transfer.stage([a.keyed for a in batch], plan) as staged:
            hooks = HookChain(staged)
            replan = None if replanner is None else (lambda h: replanner(h, staged, hooks, start))
            outs = self.pipeline.runner.run(staged.requests, plan, hooks, replan=replan)
            for out in outs:
                out.first_token  # reading the argmax synchronizes with the device
            return outs, time.perf_counter() - start, staged.stall_s

    def _replanner(self, decision: ScheduleDecision, batch: list[Admitted], decided: dict):
        """The runner's `replan` after layer 0: plan from the real entropies under the decision's
        budget, stage what the plan reads, and join the runtime monitor to the layer hooks."""
        planner = self.planner
        shape = batch_shape([a.queued for a in batch])

        def replan(entropies, staged, hooks: HookChain, start: float):
            reqs = [PlanRequest(a.queued.context_tokens, a.queued.suffix_tokens, a.queued.prefix_tokens, e)
                    for a, e in zip(batch, entropies)]
            plan = planner.plan(reqs, decision.budget_s)
            config = plan.recompute_config()
            staged.set_plan(config)
            monitor = RuntimeMonitor(plan, planner.cost, shape, steps_done=1,
                                     time_scale=planner.correction.get(plan.signal, 1.0))
            monitor.start(at=start)
            hooks.hooks.append(monitor)
            decided.update(plan=plan, monitor=monitor)
            return config, list(plan.coverages)

        return replan

    def _decode(self, batch, outs, coverages, seconds, stall, label, plan=None, replans=0) -> BatchExecution:
        """Greedy answers, after the clock stopped (decode runs off the TTFT clock)."""
        outputs = []
        for adm, out, cov in zip(batch, outs, coverages):
            ids = greedy_decode(self.pipeline.model, out.logits, out.cache, adm.request.instance.max_new_tokens)
            outputs.append(RequestOutput(self.pipeline.tokenizer.decode(ids).strip(), float(cov), out.num_context,
                                         int(out.selected.numel()), out.qci_entropy))
        return BatchExecution(outputs, seconds, stall, label, plan, replans)
