"""The simulator's runtime (DESIGN.md §5 `simulate`): the Engine's executor with no model. A batch
takes the cost model's TTFT (transfer over the simulated link included) and each request's gate
verdict is read from the outcome tables under the plan it ran.

In: a `ScheduleDecision` and the `Admitted` requests it names, whose `request.instance` is an
`Outcome` (token counts, QCI entropy, verdicts). Out: `BatchExecution` (seconds, stall, plan,
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

INFINITE_GBPS = 1e9  # a link that never stalls: what compute alone takes


class SimExecutor:
    def __init__(self, table: OutcomeTable, planner: Planner, link: CostModel) -> None:
        self.table, self.planner = table, planner
        self.link = link  # the simulated machine: the profile's costs over the simulated link
        self.compute_only = link.with_bandwidth(INFINITE_GBPS)

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
        seconds = float(self.link.ttft(shape, signal, w, p, cov)[0])
        stall = max(0.0, seconds - float(self.compute_only.ttft(shape, signal, w, p, cov)[0]))
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
