"""The served workload's demand, learned while serving.

In: the profile's `DemandModel` (the prior: its served-mix curves) and, as they come, shadow samples
(a served request re-run in idle time at full prefill and the profiler's coverage ladder, judged by
fidelity: its whole passing interval per signal and anchor depth, `calibration.shadow`) and client
verdicts (one point of one request's interval: passed or failed at the coverage it ran). Out: the
pass probability per (signal, rank depth) on the 5% demand grid, for the planner to price
hint-free plans with, and how far it moved from the prior (`shift`).

Per anchor depth and grid point, the estimate pools the prior's pass rate, counted as
`prior_weight` requests, with every sample that says something about that point, over the latest
`max_samples`: a shadow sample speaks for the whole grid; a verdict passed at coverage c speaks for
c and above (one flip assumed), failed at c for c and below. So a workload the profile never saw
takes over its own curves after a few tens of samples, and one that drifts is followed. A verdict
at a depth between anchors counts for the nearest anchor. Never touches tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.planner.demand import COVERAGE_GRID, DemandModel, read_at


@dataclass(frozen=True)
class LearnedDemandConfig:
    prior_weight: float = 20.0  # how many samples the profile's curve counts as
    max_samples: int = 500  # the window of latest samples and verdicts

    def __post_init__(self) -> None:
        if not self.prior_weight > 0:
            raise ConfigError(f"prior_weight={self.prior_weight}: must be > 0")
        if self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}: must be at least 1")


class LearnedDemand:
    def __init__(self, prior: DemandModel, config: LearnedDemandConfig | None = None) -> None:
        self.prior = prior
        self.config = config = config or LearnedDemandConfig()
        # (signal, anchor depth, passes [21], known [21]) per sample or verdict, latest last
        self._points: deque[tuple[str, int, np.ndarray, np.ndarray]] = deque()
        # per (signal, anchor): the window's passes and knowns summed [21] each, kept as points come
        # and go, so pricing a plan reads two arrays whatever the window holds
        self._sums: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self.num_samples = 0  # shadow samples taken in (each adds one point per measured curve)
        self.num_verdicts = 0
        self.version = 0  # bumped at every change: the planner's cached envelopes follow it

    @property
    def is_active(self) -> bool:
        """Whether the learned curves price plans: from the first shadow sample on (a verdict alone
        only says one point; the served mix's task re-weighting reads those before then)."""
        return self.num_samples > 0

    def observe_sample(self, intervals: dict[tuple[str, int], tuple[float, float]]) -> None:
        """One request's [from, until) passing interval per (signal, anchor depth) measured."""
        known = np.ones(len(COVERAGE_GRID), bool)
        for (signal, depth), (start, until) in intervals.items():
            if signal not in self.prior.signals:
                continue
            passes = (COVERAGE_GRID + 1e-9 >= start) & (COVERAGE_GRID + 1e-9 < until)
            self._add((signal, self._anchor(signal, depth), passes, known))
        self.num_samples += 1
        self.version += 1

    def observe_verdict(self, signal: str, rank_depth: int, coverage: float, passed: bool) -> None:
        """A served request's verdict at the coverage it ran (one flip assumed on either side)."""
        if signal not in self.prior.signals:
            return
        known = COVERAGE_GRID + 1e-9 >= coverage if passed else COVERAGE_GRID <= coverage + 1e-9
        passes = known if passed else np.zeros(len(COVERAGE_GRID), bool)
        self._add((signal, self._anchor(signal, rank_depth), passes, known))
        self.num_verdicts += 1
        self.version += 1

    def _add(self, point: tuple[str, int, np.ndarray, np.ndarray]) -> None:
        self._points.append(point)
        self._count(point, 1)
        if len(self._points) > self.config.max_samples:
            self._count(self._points.popleft(), -1)

    def _count(self, point: tuple[str, int, np.ndarray, np.ndarray], sign: int) -> None:
        signal, anchor, passes, known = point
        zero = np.zeros(len(COVERAGE_GRID))
        passed, weight = self._sums.get((signal, anchor), (zero, zero))
        self._sums[(signal, anchor)] = (passed + sign * (passes & known), weight + sign * known)

    def _anchor(self, signal: str, depth: int) -> int:
        anchors = self.prior.anchors(signal)
        return min(anchors, key=lambda a: (abs(a - depth), a))

    def anchor_cdf(self, signal: str, anchor: int) -> np.ndarray:
        """The pooled pass probability at one anchor depth [21]."""
        w = self.config.prior_weight
        zero = np.zeros(len(COVERAGE_GRID))
        passed, weight = self._sums.get((signal, anchor), (zero, zero))
        return (w * self.prior.cdf(signal, anchor) + passed) / (w + weight)

    def cdf(self, signal: str, rank_depth: float) -> np.ndarray:
        """Pass probability on the grid at `rank_depth`, linear between anchors, clamped outside."""
        anchors = self.prior.anchors(signal)
        if rank_depth <= anchors[0]:
            return self.anchor_cdf(signal, anchors[0])
        if rank_depth >= anchors[-1]:
            return self.anchor_cdf(signal, anchors[-1])
        hi = next(i for i, a in enumerate(anchors) if a >= rank_depth)
        lo_d, hi_d = anchors[hi - 1], anchors[hi]
        t = (rank_depth - lo_d) / (hi_d - lo_d)
        return (1 - t) * self.anchor_cdf(signal, lo_d) + t * self.anchor_cdf(signal, hi_d)

    def pass_probability(self, signal: str, rank_depth: float, coverages) -> np.ndarray:
        return read_at(self.cdf(signal, rank_depth), coverages)

    def shift(self) -> float:
        """The largest move of any anchor curve from the profile's, in pass probability."""
        moves = [np.abs(self.anchor_cdf(s, a) - self.prior.cdf(s, a)).max()
                 for s in self.prior.signals for a in self.prior.anchors(s)]
        return float(max(moves, default=0.0))
