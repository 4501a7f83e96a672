"""The runtime monitor (paper §5.1, last paragraph): a runner hook that compares the batch's
progress with the plan's schedule and, when the batch would end past its budget (a slow link,
contention), re-plans the coverage of the remaining Patch layers so the batch still meets it.

In: the `BatchPlan`, the cost model and batch shape it was made with, and optionally a callable
giving the measured link bandwidth. Out, via `after_layer`: lowered coverages {request: coverage}
that the runner applies to the remaining Patch layers. Coverage is only ever lowered.

Why it predicts the end instead of reacting to one late layer: every cut costs quality (a
CacheBlend-family request at 10% passes about twice as often as at 0%) and time of its own (the
dropped rows' cached KV must be loaded for every remaining layer), while one layer on a shared
2-core machine often runs 20-30% over its estimate and the next one under it. So the monitor keeps
a pace (the median of measured / planned seconds over the last five Patch layers, padded with
on-pace ones while fewer than three ran), predicts the end at that pace, and cuts only when that
end passes its target by more than the tolerance (or passes the scheduler's limit at all), to the
largest coverage whose predicted end fits with the cost of a cut (measured on the layer after an
earlier one) reserved, and only if the cut saves more than that cost. The target is the budget,
or, given the scheduler's limit (the latest end that costs nobody a deadline), that limit less what
runs after the layers (`tail_s`, measured by the executor) and less a margin proportional to the
time still to run: the budget's own margin was set for the noise of the whole batch, and less of it
is left the further the batch has run.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel, phase_seconds, step_features
from cachesmith.planner.planner import BatchPlan
from cachesmith.recompute.hooks import LayerInfo, RunnerHooks

SCALES = np.linspace(1.0, 0.0, 41)  # candidate multipliers of the current coverages
PACE_WINDOW = 5  # the pace is the median ratio of the last few layers: a lasting slowdown shows fast
MIN_LAYERS = 3  # fewer measured layers are padded with on-pace ones: one noisy layer does not cut
MAX_PACE = 4.0


class RuntimeMonitor(RunnerHooks):
    def __init__(self, plan: BatchPlan, cost: CostModel, shape: BatchShape, tolerance: float = 0.05,
                 bandwidth: Callable[[], float | None] | None = None, steps_done: int = 0,
                 time_scale: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 limit_s: float | None = None, margin: float = 0.08, tail_s: float = 0.0) -> None:
        self.plan, self.cost, self.shape = plan, cost, shape
        # past the budget, up to the scheduler's limit (nobody's deadline lost), less a margin for
        # the noise of what is left to run: a late batch ends there rather than lose its coverage.
        # `tail_s` is what runs after the last layer (the LM head, the first tokens), which the
        # limit must hold too: without it a batch let run to the limit ended a few ms past a deadline
        self.limit_s, self.margin, self.tail_s = limit_s, margin, tail_s
        self.clock = clock  # the simulator's executor drives the monitor on its virtual time
        self.tolerance = tolerance
        self.bandwidth = bandwidth
        self.coverages = np.array(plan.coverages, float)
        steps, ends = cost.schedule(shape, plan.signal, plan.warmup, plan.probe, self.coverages)
        self.time_scale = time_scale  # the planner's learned correction of the cost model
        self.steps, self.planned_end = steps, ends[:, 0] * time_scale
        is_patch = np.array([s.kind == "patch" for s in steps], bool)  # [num_steps]
        self._patches_after = is_patch[::-1].cumsum()[::-1] - is_patch  # [num_steps] Patch steps after j
        self.num_replans = 0
        self.pace: float | None = None  # elapsed / planned at the last step run on the original plan
        self.layer_pace = 1.0  # measured / planned seconds of recent Patch layers (median)
        self._ratios: list[float] = []  # measured / planned seconds of the recent Patch layers
        self._is_after_replan = False
        self.cut_cost_s = 0.0  # seconds a cut added to the layer after it (measured on the first)
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
        if j >= len(self.planned_end):
            return None
        if self.num_replans == 0 and self.planned_end[j] > 0:
            self.pace = elapsed / float(self.planned_end[j])
        if last is not None and 0 < j and info.phase == "patch" and self.steps[j].kind == "patch":
            # plain Patch layers only: kv_dev's scoring layer is another kind (the cost model
            # underestimates it about 2x) and a one-off, as are WarmUp and probe layers
            self._learn(now - last, float(self.planned_end[j] - self.planned_end[j - 1]))
        if info.phase != "patch":  # the runner applies lowered coverage after Patch passes only
            return None
        return self._decide(j, elapsed)

    def _decide(self, j: int, elapsed: float) -> dict[int, float] | None:
        """Cut when the end predicted at the measured pace passes the target, to the largest scale
        that fits with the cost of the cut itself (measured on an earlier cut) reserved, and only
        when the cut saves more time than it costs."""
        num_left = int(self._patches_after[j])
        if not num_left or not self.coverages.any():
            return None
        seconds = np.diff(self.planned_end[j:])  # [steps left] as planned
        left = float(seconds.sum())
        target = self.target_s(elapsed)
        if elapsed + self.layer_pace * left <= self.tolerated_s(target):
            return None
        other = sum(t for t, s in zip(seconds, self.steps[j + 1:]) if s.kind != "patch")  # probes left
        need = num_left * self.layer_pace * self._patch_seconds(SCALES[:, None] * self.coverages[None, :])  # [S]
        fits = np.nonzero(need <= target - elapsed - self.layer_pace * other - self.cut_cost_s)[0]
        k = int(fits[0]) if fits.size else len(SCALES) - 1  # SCALES fall from 1 to 0: the largest that fits
        if k == 0 or need[0] - need[k] <= self.cut_cost_s:  # nothing to cut, or a cut saves less than it costs
            return None
        return self._lower(j, float(SCALES[k]), elapsed)

    def target_s(self, elapsed: float) -> float:
        """The latest end the monitor lets the batch run to, `elapsed` seconds after its start."""
        budget, limit = self.plan.budget_s, self.layers_limit_s
        if limit is None or limit <= budget:
            return budget
        return max(budget, limit - self.margin * (limit - elapsed))

    def tolerated_s(self, target: float) -> float:
        """The predicted end that still cuts nothing: the target plus the tolerance, which spares
        the quality of a batch whose pace is noise, but never past the limit less the tail. Past
        it the batch misses a deadline: replays of bursts ended batches 0.2-1% past their
        requests' deadlines, inside the tolerance and uncut."""
        tolerated = target + self.tolerance * self.plan.budget_s
        limit = self.layers_limit_s
        return tolerated if limit is None else min(tolerated, max(target, limit))

    @property
    def layers_limit_s(self) -> float | None:
        """The latest end of the layers: the scheduler's limit less the tail (None: no limit)."""
        return None if self.limit_s is None else self.limit_s - self.tail_s

    @property
    def walk_s(self) -> float | None:
        """Seconds from the batch's start to the end of the last layer seen (None before one)."""
        return None if self._start is None or self._last is None else self._last - self._start

    def _learn(self, measured: float, planned: float) -> None:
        """Fold one layer into the pace, except the layer after a cut: it also loads the dropped
        rows' cached KV for every remaining layer, a one-off kept as the price of the next cut."""
        if self._is_after_replan:
            self._is_after_replan = False
            self.cut_cost_s = max(self.cut_cost_s, measured - planned * self.layer_pace)
            return
        if planned <= 0:
            return
        self._ratios = [*self._ratios[1 - PACE_WINDOW:], measured / planned]
        padded = self._ratios + [1.0] * (MIN_LAYERS - len(self._ratios))
        self.layer_pace = min(MAX_PACE, float(np.median(padded)))

    def _lower(self, j: int, scale: float, elapsed: float) -> dict[int, float]:
        self.num_replans += 1
        self.coverages = self.coverages * scale
        self._is_after_replan = True
        # later steps are now measured against the lowered plan from here on (probes left keep theirs)
        patch_s = float(self._patch_seconds(self.coverages[None, :])[0])
        seconds = np.diff(self.planned_end[j:])
        self.planned_end[j] = elapsed  # the next layer is priced from now
        self.planned_end[j + 1:] = elapsed + np.cumsum(
            [patch_s if s.kind == "patch" else t for t, s in zip(seconds, self.steps[j + 1:])])
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
