"""The shadow work of a learning serving engine (`cachesmith+learn`): the profiler's measuring,
fitted into idle time by `cachesmith.shadow_work`.

In: the engine's pipeline, its planner and a `ShadowConfig`. Out: a `ShadowCalibrator` whose units
run the workload profile's searches (`workload_keys`, the fidelity gate, the planner's saturation
cap), with verdicts kept in memory only, and hand each sample to the planner (`observe_sample`).
Whoever builds a learning engine passes `shadow_calibrator` as `EngineConfig.shadow_work`: the
engine sits below the profiler and imports none of it.
"""
from __future__ import annotations

from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner
from cachesmith.profiler.demand import DemandProfiler
from cachesmith.profiler.workload import DEFAULT_MAX_COVERAGE, workload_keys
from cachesmith.shadow_work import ShadowCalibrator, ShadowConfig


def shadow_calibrator(pipe: RagPipeline, planner: Planner, config: ShadowConfig | None = None) -> ShadowCalibrator:
    """The calibrator of a serving engine (a `shadow_work.ShadowFactory`)."""
    profiler = DemandProfiler(pipe, None, gate="fidelity", max_coverage=DEFAULT_MAX_COVERAGE, num_parallel=1)
    return ShadowCalibrator(profiler, workload_keys(profiler), planner.observe_sample, config)
