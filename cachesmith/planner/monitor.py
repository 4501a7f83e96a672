"""The runtime monitor (paper §5.1, last paragraph): a runner hook that compares each layer's
finish time with the plan's schedule and, when the batch runs late (a slow link, contention),
re-plans the coverage of the remaining Patch layers so the batch still meets its budget.

In: the `BatchPlan`, the cost model and batch shape it was made with, and optionally a callable
giving the measured link bandwidth. Out, via `after_layer`: lowered coverages {request: coverage}
that the runner applies to the remaining Patch layers. Coverage is only ever lowered.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel, phase_seconds, step_features
from cachesmith.planner.planner import BatchPlan
from cachesmith.recompute.hooks import LayerInfo, RunnerHooks

SCALES = np.linspace(1.0, 0.0, 41)  # candidate multipliers of the current coverages


class RuntimeMonitor(RunnerHooks):
    def __init__(self, plan: BatchPlan, cost: CostModel, shape: BatchShape, tolerance: float = 0.05,
                 bandwidth: Callable[[], float | None] | None = None, steps_done: int = 0,
                 time_scale: float = 1.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.plan, self.cost, self.shape = plan, cost, shape
        self.clock = clock  # the simulator's executor drives the monitor on its virtual time
        self.tolerance = tolerance
        self.bandwidth = bandwidth
        self.coverages = np.array(plan.coverages, float)
        steps, ends = cost.schedule(shape, plan.signal, plan.warmup, plan.probe, self.coverages)
        self.time_scale = time_scale  # the planner's learned correction of the cost model
        self.steps, self.planned_end = steps, ends[:, 0] * time_scale
        self.num_replans = 0
        self.drift_s = 0.0
        self.pace: float | None = None  # elapsed / planned at the last step run on the original plan
        self._step = steps_done  # a monitor attached after layer 0 (plan decided there) starts at 1
        self._start: float | None = None
        self._last: float | None = None

    def start(self, at: float | None = None) -> None:
        """Call when the batch starts (before staging), so elapsed time matches the TTFT clock;
        `at` (a `clock()` reading) when the batch started before the monitor existed."""
        self._start = self.clock() if at is None else at

    def before_layer(self, layer: int, phase: str) -> None:
        if self._start is None:
            self.start()
        if self._last is None:
            self._last = self.clock()

    def after_layer(self, info: LayerInfo) -> dict[int, float] | None:
        j = self._step
        self._step += 1
        now = self.clock()
        elapsed = now - self._start
        last, self._last = self._last, now
        if (last is not None and 0 < j < len(self.planned_end) and info.phase == "patch"
                and self.steps[j].kind == "patch"):
            # what a Patch layer really takes beyond the plan's estimate of that same step (a slow
            # link, contention, model error); it is assumed to persist over the remaining layers.
            # Plain Patch layers only: kv_dev's scoring layer is another kind, and a one-off.
            planned = self.planned_end[j] - self.planned_end[j - 1]
            self.drift_s = max(0.0, (now - last) - float(planned))
        if self.num_replans == 0 and j < len(self.planned_end) and self.planned_end[j] > 0:
            self.pace = elapsed / float(self.planned_end[j])
        remaining = [s for s in self.steps[j + 1:] if s.kind == "patch"]
        if j >= len(self.planned_end) or not remaining:
            return None
        if elapsed <= self.planned_end[j] * (1 + self.tolerance):
            return None
        scale = self._feasible_scale(len(remaining), self.plan.budget_s - elapsed)
        if scale >= 1.0:
            return None
        self.num_replans += 1
        self.coverages = self.coverages * scale
        # later steps are now measured against the lowered plan from here on
        self.planned_end[j + 1:] = elapsed + np.cumsum(
            [self._patch_seconds(self.coverages[None, :])[0]] * len(self.steps[j + 1:]))
        return {i: float(c) for i, c in enumerate(self.coverages)}

    def _patch_seconds(self, coverages: np.ndarray) -> np.ndarray:
        """Compute + reused-row transfer of one Patch layer at the current link speed [K]."""
        model = self.cost
        gbps = self.bandwidth() if self.bandwidth else None
        if gbps:
            model = model.with_bandwidth(gbps)
        compute = phase_seconds(model.profile.layer_costs["patch"], step_features("patch", self.shape, coverages))
        link = model.load_bytes("reused", self.shape, coverages) / (model.bandwidth_gbps * 1e9)
        return np.maximum(compute * self.time_scale, link)  # later loads overlap this layer's compute

    def _feasible_scale(self, num_layers_left: int, time_left: float) -> float:
        candidates = SCALES[:, None] * self.coverages[None, :]  # [S, R]
        need = num_layers_left * (self._patch_seconds(candidates) + self.drift_s)
        ok = np.nonzero(need <= time_left)[0]
        return float(SCALES[ok[0]]) if ok.size else 0.0
