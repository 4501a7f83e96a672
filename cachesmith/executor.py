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
from cachesmith.planner import BatchPlan, BatchShape, Planner, PlanRequest
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.recompute import HookChain, RecomputeConfig, RunnerHooks, Signal
from cachesmith.request import Request
from cachesmith.scheduler import QueuedRequest, ScheduleDecision

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
    plan: BatchPlan | None  # "planned" batches
    planner_s: float  # the planner's decision time (inside `seconds`; staging the plan is not in it)
    num_monitor_replans: int = 0


class _Deferred(RunnerHooks):
    """Forwards to a hook that exists only once the plan is decided (the monitor)."""

    def __init__(self) -> None:
        self.target = None

    def before_layer(self, layer: int, phase: str) -> None:
        if self.target is not None:
            self.target.before_layer(layer, phase)

    def after_selection(self, selected) -> None:
        if self.target is not None:
            self.target.after_selection(selected)

    def after_layer(self, info):
        return None if self.target is None else self.target.after_layer(info)


class BatchExecutor:
    def __init__(self, pipeline: RagPipeline, planner: Planner | None = None) -> None:
        self.pipeline, self.planner = pipeline, planner

    def execute(self, decision: ScheduleDecision, batch: list[Admitted]) -> BatchExecution:
        if decision.mode == "planned":
            if self.planner is None:
                raise ValueError("a planned batch needs the executor's planner")
            run = self._planned(decision, batch)
        else:
            run = self._static(decision, batch)
        outs, seconds, stall, label, plan, planner_s, replans = run
        outputs = []
        for adm, out, cov in zip(batch, outs, plan.coverages if plan else [decision.coverage] * len(batch)):
            ids = greedy_decode(self.pipeline.model, out.logits, out.cache, adm.request.instance.max_new_tokens)
            outputs.append(RequestOutput(self.pipeline.tokenizer.decode(ids).strip(), float(cov), out.num_context,
                                         int(out.selected.numel()), out.qci_entropy))
        return BatchExecution(outputs, seconds, stall, label, plan, planner_s, replans)

    def _static(self, decision: ScheduleDecision, batch: list[Admitted]):
        plan = replace(decision.static_plan, coverage=decision.coverage)
        keyed = [replace(a.keyed, coverage=None) for a in batch]
        start = time.perf_counter()
        with self.pipeline.transfer.stage(keyed, plan) as staged:
            outs = self.pipeline.runner.run(staged.requests, plan, staged)
            [o.first_token for o in outs]  # reading the argmax synchronizes with the device
            seconds = time.perf_counter() - start
            stall = staged.stall_s
        return outs, seconds, stall, plan.label(), None, 0.0, 0

    def _planned(self, decision: ScheduleDecision, batch: list[Admitted]):
        planner = self.planner
        shape = BatchShape(tuple(a.queued.context_tokens for a in batch), tuple(a.queued.suffix_tokens for a in batch),
                           tuple(a.queued.prefix_tokens for a in batch))
        monitor_slot, decided = _Deferred(), {}
        keyed = [replace(a.keyed, coverage=None) for a in batch]
        start = time.perf_counter()
        with self.pipeline.transfer.stage(keyed, PROVISIONAL) as staged:
            def replan(entropies):
                reqs = [PlanRequest(a.queued.context_tokens, a.queued.suffix_tokens, a.queued.prefix_tokens, e)
                        for a, e in zip(batch, entropies)]
                plan = planner.plan(reqs, decision.budget_s)
                config = plan.recompute_config()
                staged.set_plan(config)
                scale = planner.correction.get(plan.signal, 1.0)
                monitor = RuntimeMonitor(plan, planner.cost, shape, steps_done=1, time_scale=scale)
                monitor.start(at=start)
                monitor_slot.target = monitor
                decided.update(plan=plan, monitor=monitor, planner_s=plan.decision_s)
                return config, list(plan.coverages)

            outs = self.pipeline.runner.run(staged.requests, PROVISIONAL, HookChain(staged, monitor_slot),
                                            replan=replan)
            [o.first_token for o in outs]
            seconds = time.perf_counter() - start
            stall = staged.stall_s
        plan, monitor = decided["plan"], decided["monitor"]
        if monitor.pace is not None:  # pace is relative to the corrected schedule
            planner.observe(plan.signal, monitor.time_scale * monitor.pace)
        return (outs, seconds, stall, plan.recompute_config().label(), plan, decided["planner_s"],
                monitor.num_replans)
