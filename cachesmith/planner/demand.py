"""Demand distributions as pass probabilities (paper §5.1, Fig. 7).

In: the profile's `DemandCurve`s: each profiling request's minimum sufficient coverage, per signal,
at anchor rank depths (5%, 20%, 50% of the layers, p = 1). Out: P(pass | signal, rank depth,
coverage) = the fraction of profiled requests whose demand is at most that coverage, linearly
interpolated between anchor depths and clamped outside them. The planner compares candidate rank
depths with it; it need not predict any one request's demand.
"""
from __future__ import annotations

import numpy as np

from cachesmith.planner.profile import DemandCurve, ProfileError

COVERAGE_GRID = np.round(np.arange(0, 21) * 0.05, 2)  # the 5% grid demands are measured on


class DemandModel:
    def __init__(self, curves: tuple[DemandCurve, ...]) -> None:
        self._tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        by_signal: dict[str, list[DemandCurve]] = {}
        for curve in curves:
            if not curve.demands:
                raise ProfileError(f"demand curve {curve.signal}@{curve.rank_depth} holds no requests")
            by_signal.setdefault(curve.signal, []).append(curve)
        for signal, group in by_signal.items():
            group.sort(key=lambda cv: cv.rank_depth)
            depths = np.array([cv.rank_depth for cv in group], float)
            # cdf[a, g]: fraction of requests passing at COVERAGE_GRID[g] with anchor depth a
            cdf = np.stack([(np.asarray(cv.demands)[None, :] <= COVERAGE_GRID[:, None] + 1e-9).mean(1)
                            for cv in group])
            self._tables[signal] = (depths, cdf)

    @property
    def signals(self) -> list[str]:
        return sorted(self._tables)

    def cdf(self, signal: str, rank_depth: float) -> np.ndarray:
        """Pass probability on COVERAGE_GRID [21] at `rank_depth`."""
        if signal not in self._tables:
            raise ProfileError(f"the profile has no demand distribution for signal {signal!r}; "
                               f"it has {', '.join(self.signals) or 'none'}")
        depths, cdf = self._tables[signal]
        if rank_depth <= depths[0]:
            return cdf[0]
        if rank_depth >= depths[-1]:
            return cdf[-1]
        hi = int(np.searchsorted(depths, rank_depth))
        f = (rank_depth - depths[hi - 1]) / (depths[hi] - depths[hi - 1])
        return (1 - f) * cdf[hi - 1] + f * cdf[hi]

    def pass_probability(self, signal: str, rank_depth: float, coverages) -> np.ndarray:
        """P(pass) at arbitrary coverages: the step CDF read at the 5% grid point at or below."""
        cdf = self.cdf(signal, rank_depth)
        index = np.floor(np.asarray(coverages, float) / 0.05 + 1e-9).astype(int).clip(0, 20)
        return cdf[index]

    def quantile(self, signal: str, rank_depth: float, q: float) -> float:
        """Smallest grid coverage passing at least a fraction q of requests (inf if none)."""
        cdf = self.cdf(signal, rank_depth)
        hits = np.nonzero(cdf >= q - 1e-9)[0]
        return float(COVERAGE_GRID[hits[0]]) if hits.size else float("inf")
