"""The shadow work of a learning serving engine (`cachesmith+learn`): demand measuring
(`DemandProfiler`) on served requests, fitted into idle time by `cachesmith.shadow_work`.

In: the engine's pipeline, its planner and a `ShadowConfig`. Out: a `ShadowCalibrator` whose units
run the workload profile's searches (`workload_keys`, the fidelity gate, the planner's saturation
cap), with verdicts kept in memory only, and hand each sample to the planner (`observe_sample`).
Each served `Request` is handed to the profiler as plain data (`served_subject`). Whoever
builds a learning engine passes `shadow_calibrator` as `EngineConfig.shadow_work`: the engine sits
below this package and imports none of it.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from cachesmith.calibration.demand import DemandProfiler
from cachesmith.calibration.subjects import served_subject
from cachesmith.calibration.workload_demand import DEFAULT_MAX_COVERAGE, workload_keys
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner
from cachesmith.request import Request
from cachesmith.shadow_work import Intervals, ShadowCalibrator, ShadowConfig


@dataclass
class ServedSampler:
    """A `shadow_work.Sampler` over a `DemandProfiler`: each served request measured as a `Subject`."""
    profiler: DemandProfiler

    def sample_rounds(self, request: Request, keys: list[tuple[str, int]]) -> Generator[None, None, Intervals]:
        # a generator, so a request that cannot be measured fails inside the unit, as a skipped sample
        return (yield from self.profiler.sample_rounds(served_subject(request), keys))


def shadow_calibrator(pipe: RagPipeline, planner: Planner, config: ShadowConfig | None = None) -> ShadowCalibrator:
    """The calibrator of a serving engine (a `shadow_work.ShadowFactory`)."""
    profiler = DemandProfiler(pipe, None, gate="fidelity", max_coverage=DEFAULT_MAX_COVERAGE, num_parallel=1)
    return ShadowCalibrator(ServedSampler(profiler), workload_keys(profiler), planner.observe_sample, config)
