"""Plans one request alone, as the server would on an idle machine, and answers it under that plan:
the Python API's planned answer and what `cachesmith ask` runs when given no fixed method.

In: a pipeline (the model the profile must fit, and the answer's runner), a prompt and a TTFT SLO.
Out: a `OnePlan` (the `RecomputeConfig` to run, the planner's price of it and the decision's time),
or the pipeline's `Answer` under it with the decision's time added to the TTFT and the planner's
price as `planned_s`. The profile is chosen by the server's rule (`calibration.packaged.serving_profile`):
the one `cachesmith profile` measured on this machine, else the packaged one calibrated to it. The
budget is the SLO-aware scheduler's for a queue of this one request; the plan is the planner's for a
batch of one, with the robust signal rule of plain `cachesmith` (it needs no layer-0 entropy, so
planning before the run decides what the serving executor decides after layer 0). No runtime
monitor: the plan runs as chosen.

This module sits above the pipeline, the planner, the scheduler and the profiler, and none of them
imports it (docs/adr/0037-layers-without-cycles.md): the pipeline runs the plan it is
given. Callers that hold a pipeline but no planner take the one kept for it (`one_planner`).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cachesmith.methods import parse_method
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import Answer, RagPipeline
from cachesmith.request import DEFAULT_SLO_S, check_slo
from cachesmith.planner import Planner, PlannerConfig, PlanRequest, Profile
from cachesmith.calibration.packaged import serving_profile
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
        """With the serving profile of `pipe`'s model, dtype and device (`calibration.packaged.serving_profile`):
        the one at `path`, else measured here, else the packaged one calibrated (seconds)."""
        return cls.of(*serving_profile(pipe, path))

    def plan(self, parts: PromptParts, slo_s: float) -> OnePlan:
        """The plan of the request `parts` alone under `slo_s` seconds of TTFT."""
        check_slo(slo_s, "slo_s")
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

    def answer(self, pipe: RagPipeline, documents: Sequence[str], question: str, slo_s: float = DEFAULT_SLO_S,
               max_new_tokens: int = 32, answer_prefix: str = "", system: str | None = None) -> Answer:
        """`pipe`'s answer under the plan of this request alone (`RagPipeline.answer`, planned)."""
        return self.answer_parts(pipe, pipe.prompt(documents, question, answer_prefix, system), slo_s, max_new_tokens)

    def answer_parts(self, pipe: RagPipeline, parts: PromptParts, slo_s: float = DEFAULT_SLO_S,
                     max_new_tokens: int = 32) -> Answer:
        """`answer` of a prompt in hand. The decision's time counts in the TTFT, as the scheduler's
        and planner's do when serving."""
        chosen = self.plan(parts, slo_s)
        ans = pipe.answer_parts(parts, chosen.config, max_new_tokens)
        return replace(ans, ttft_s=ans.ttft_s + chosen.decision_s, planned_s=chosen.planned_s)


# the planner kept per pipeline, for callers that hold a pipeline but no planner (`one_planner`);
# weak keys: a pipeline's planner goes with it
_KEPT: weakref.WeakKeyDictionary[RagPipeline, OnePlanner] = weakref.WeakKeyDictionary()
_KEPT_LOCK = threading.Lock()


def one_planner(pipe: RagPipeline, path: Path | None = None) -> OnePlanner:
    """The planner kept for `pipe`, built on first use (`OnePlanner.for_pipeline`: `path` counts on
    that first call only): loading a profile, and calibrating a packaged one to this machine, takes
    seconds that only the first planned answer pays, and fixed plans never do."""
    with _KEPT_LOCK:  # one build, even when two threads plan the pipeline's first requests at once
        if pipe not in _KEPT:
            _KEPT[pipe] = OnePlanner.for_pipeline(pipe, path)
        return _KEPT[pipe]


def use_profile(pipe: RagPipeline, profile: Profile, source: str = "given") -> OnePlanner:
    """Plan `pipe`'s requests with `profile` (one in hand, e.g. measured by the caller) from now on."""
    with _KEPT_LOCK:
        _KEPT[pipe] = planner = OnePlanner.of(profile, source)
    return planner
