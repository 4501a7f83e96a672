"""Plans one request alone, as the server would on an idle machine: what `RagPipeline.answer`
runs when it is given no plan.

In: a pipeline (for the profile), a prompt's token counts and a TTFT SLO. Out: a `OnePlan`: the
`RecomputeConfig` to run, the planner's price of it and the decision's time. The profile is chosen
by the server's rule (`profiler.packaged.serving_profile`): the one `cachesmith profile` measured on
this machine, else the packaged one calibrated to it. The budget is the SLO-aware scheduler's for
a queue of this one request; the plan is the planner's for a batch of one, with the robust signal
rule of plain `cachesmith` (it needs no layer-0 entropy, so planning before the run decides what
the serving executor decides after layer 0). No runtime monitor: the plan runs as chosen.

This module sits above the scheduler and the profiler, which sit above the pipeline (the
profiler imports it), so the pipeline reaches this one by a lazy import
(docs/adr/0035-layering-and-one-request-plans.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from cachesmith.errors import InputError
from cachesmith.methods import parse_method
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner, PlannerConfig, PlanRequest, Profile
from cachesmith.profiler.packaged import serving_profile
from cachesmith.recompute import RecomputeConfig
from cachesmith.scheduler import QueuedRequest, SloAwareScheduler

# plain `cachesmith`'s planner: signal chosen per request by the robust rule, the served mix's
# demand (a request of the Python API names no task)
PLANNER_CONFIG = parse_method("cachesmith").planner_config(PlannerConfig())


@dataclass(frozen=True)
class OnePlan:
    config: RecomputeConfig  # what runs
    mode: str  # "planned"; "full_reuse" where even the band's floor misses the SLO (past saving)
    budget_s: float  # the scheduler's budget for the request's TTFT
    planned_s: float  # the predicted TTFT of `config` (the planner's; past saving, the scheduler's)
    decision_s: float  # scheduler + planner time: on the request's clock, as when serving


@dataclass(frozen=True)
class OnePlanner:
    planner: Planner
    source: str  # where the profile came from: "measured", "packaged (speed factor ...)", "given ..."

    @classmethod
    def of(cls, profile: Profile, source: str = "given") -> OnePlanner:
        return cls(Planner(profile, PLANNER_CONFIG), source)

    @classmethod
    def for_pipeline(cls, pipe: RagPipeline, path: Path | None = None) -> OnePlanner:
        """With the serving profile of `pipe`'s model, dtype and device (`profiler.packaged.serving_profile`)."""
        return cls.of(*serving_profile(pipe, path))

    def plan(self, parts: PromptParts, slo_s: float) -> OnePlan:
        """The plan of the request `parts` alone under `slo_s` seconds of TTFT."""
        if isinstance(slo_s, bool) or not isinstance(slo_s, (int, float)) or not (math.isfinite(slo_s) and slo_s > 0):
            raise InputError(f"slo_s={slo_s!r} must be a positive, finite number of seconds")
        prefix, context, suffix = len(parts.prefix_ids), sum(len(c) for c in parts.chunk_ids), len(parts.suffix_ids)
        queued = QueuedRequest(0, 0.0, float(slo_s), context, suffix, prefix)
        # a fresh scheduler each time: no queue and no arrival history shape a lone request's budget
        decision = SloAwareScheduler(self.planner).next_batch([queued], 0.0)
        if decision.mode != "planned":  # past saving: full reuse, the rows its load time pays for
            config = replace(decision.static_plan, coverage=decision.coverage)
            return OnePlan(config, decision.mode, decision.budget_s, decision.budget_s, decision.decision_s)
        plan = self.planner.plan([PlanRequest(context, suffix, prefix)], decision.budget_s)
        return OnePlan(plan.recompute_config(), "planned", decision.budget_s, plan.predicted_ttft_s,
                       decision.decision_s + plan.decision_s)
