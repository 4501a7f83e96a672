"""The simulator's runtime (DESIGN.md §5 `simulate`): the Engine's executor with no model. A batch
takes the cost model's TTFT (transfer over the simulated link included) and each request's gate
verdict is read from the outcome tables under the plan it ran.

In: a `ScheduleDecision` and the `Admitted` requests it names, whose `request.instance` is an
`Outcome` (token counts, QCI entropy, verdicts). The machine is the cost model with each plan
family's compute at this machine's measured pace (`bench.pace`). Out: `BatchExecution` (seconds, stall, plan,
verdicts) and `RequestOutput`s with `is_passed` set. "Planned" batches ask the same `Planner` the
engine uses, from the tables' layer-0 entropies; the planner's decision time is real and counted.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from cachesmith.executor import Admitted, BatchExecution, RequestOutput, TokenHook, check_request
from cachesmith.planner import CostModel, Planner, PlanRequest
from cachesmith.request import Request
from cachesmith.scheduler import ScheduleDecision
from cachesmith.scheduler.types import batch_shape
from cachesmith.bench.outcomes import Outcome, OutcomeTable
from cachesmith.bench.pace import MULTI, family
from cachesmith.profiler.packaged import rescaled

INFINITE_GBPS = 1e9  # a link that never stalls: what compute alone takes


class SimExecutor:
    """`paces`: this machine's measured/predicted compute time per plan family (`bench.pace`);
    a family not in it runs at the profile's speed."""

    def __init__(self, table: OutcomeTable, planner: Planner, link: CostModel,
                 paces: dict[str, float] | None = None) -> None:
        self.table, self.planner, self.link = table, planner, link
        self.paces = paces or {}
        self._machines: dict[str, tuple[CostModel, CostModel]] = {}

    def machine(self, signal: str, warmup: int, probe: int, num_requests: int = 1) -> tuple[CostModel, CostModel]:
        """(the simulated machine for this plan family and batch size over the link, the same with no
        link limit): the profile's compute costs at the family's pace (its multi-request pace for
        batches of several, where measured); the link is not paced."""
        key = family(signal, warmup, probe)
        if num_requests > 1 and key + MULTI in self.paces:
            key += MULTI
        if key not in self._machines:
            paced = CostModel(rescaled(self.link.profile, self.paces.get(key, 1.0)), self.link.bandwidth_gbps)
            self._machines[key] = (paced, paced.with_bandwidth(INFINITE_GBPS))
        return self._machines[key]

    def admit(self, request: Request, kv_capacity_tokens: int) -> Admitted:
        o: Outcome = request.instance
        queued = check_request(request, o.prefix_tokens, o.context_tokens, o.suffix_tokens,
                               self.table.max_positions, kv_capacity_tokens)
        return Admitted(request, None, queued)

    def prefill(self, decision: ScheduleDecision, batch: list[Admitted]) -> BatchExecution:
        shape = batch_shape([a.queued for a in batch])
        plan, planner_s = None, 0.0
        if decision.mode == "planned":
            reqs = [PlanRequest(a.queued.context_tokens, a.queued.suffix_tokens, a.queued.prefix_tokens,
                                a.request.instance.entropy) for a in batch]
            plan = self.planner.plan(reqs, decision.budget_s)
            config, coverages, planner_s = plan.recompute_config(), list(plan.coverages), plan.decision_s
        else:
            config = replace(decision.static_plan, coverage=decision.coverage)
            coverages = [decision.coverage] * len(batch)
        signal, w, p = config.signal.value, config.warmup, config.probe
        cov = np.array([coverages])  # [1, R]
        machine, compute_only = self.machine(signal, w, p, len(batch))
        seconds = float(machine.ttft(shape, signal, w, p, cov)[0])
        stall = max(0.0, seconds - float(compute_only.ttft(shape, signal, w, p, cov)[0]))
        if plan is not None:  # as the real executor does: the planner learns this machine's pace
            self.planner.observe(signal, seconds / float(self.planner.cost.ttft(shape, signal, w, p, cov)[0]))
        verdicts = [self.table.passes(a.request.instance, signal, w, p, c) for a, c in zip(batch, coverages)]
        return BatchExecution([], coverages, planner_s + seconds, stall, config.label(), plan, 0, verdicts)

    def decode(self, batch: list[Admitted], run: BatchExecution,
               on_token: TokenHook | None = None) -> list[RequestOutput]:
        """No tokens: each request's coverage, counts and verdict."""
        out = []
        for a, cov, verdict in zip(batch, run.coverages, run.verdicts):
            o: Outcome = a.request.instance
            out.append(RequestOutput("", float(cov), o.context_tokens, int(round(cov * o.context_tokens)),
                                     o.entropy, o.num_tokens, 0, verdict))
        return out
