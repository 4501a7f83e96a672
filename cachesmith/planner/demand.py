"""Demand distributions as pass probabilities (paper §5.1, Fig. 7).

In: the profile's `DemandCurve`s: each profiling request's passing coverages (from its minimum
sufficient coverage, up to where it fails again if it does), per signal, at anchor rank depths
(5%, 20%, 50% of the layers, p = 1), over the served mix and, optionally, per task. Out:
P(pass | signal, rank depth, coverage[, task]) = the fraction of profiled requests passing at that
coverage, linearly interpolated between anchor depths and clamped outside them. It need not rise
with coverage: requests that pass on their isolated chunks and fail on the restored context make
it dip. The planner still plans the most coverage its budget reaches: on 57 profiling requests a
dip is one or two requests, and planning into it lost settings on held-out outcomes. A task the profile has no curves for reads the served mix's. The planner compares
candidate rank depths and signals with it; it need not predict any one request's demand.
"""
from __future__ import annotations

import numpy as np

from cachesmith.planner.profile import DemandCurve, ProfileError

COVERAGE_GRID = np.round(np.arange(0, 21) * 0.05, 2)  # the 5% grid demands are measured on


def read_index(coverages) -> np.ndarray:
    """The demand grid point at or below each of arbitrary coverages."""
    index = np.floor(np.asarray(coverages, float) / 0.05 + 1e-9).astype(int)
    return np.minimum(np.maximum(index, 0), 20)  # `clip`, without its Python-level wrapper


def read_at(cdf: np.ndarray, coverages) -> np.ndarray:
    """A pass probability on the demand grid [21] (or several stacked [G, 21]) read at arbitrary
    coverages: the grid point at or below each."""
    return cdf[..., read_index(coverages)]


class DemandModel:
    def __init__(self, curves: tuple[DemandCurve, ...]) -> None:
        # (task or None for the served mix, signal) -> (anchor depths [A], cdf [A, 21])
        self._tables: dict[tuple[str | None, str], tuple[np.ndarray, np.ndarray]] = {}
        self._sizes: dict[str | None, int] = {}  # requests profiled per task (None: the served mix)
        groups: dict[tuple[str | None, str], list[DemandCurve]] = {}
        for curve in curves:
            if not curve.demands:
                raise ProfileError(f"demand curve {curve.signal}@{curve.rank_depth} holds no requests")
            groups.setdefault((curve.task, curve.signal), []).append(curve)
        if groups and not any(task is None for task, _ in groups):
            raise ProfileError("the profile's demand curves are all per task; it needs the served mix's too")
        for key, group in groups.items():
            group.sort(key=lambda cv: cv.rank_depth)
            self._sizes[key[0]] = max(self._sizes.get(key[0], 0), *(len(cv.demands) for cv in group))
            depths = np.array([cv.rank_depth for cv in group], float)
            # cdf[a, g]: fraction of requests passing at COVERAGE_GRID[g] with anchor depth a
            cdf = np.stack([cv.pass_rate(COVERAGE_GRID) for cv in group])
            self._tables[key] = (depths, cdf)
        # read by every decision: sorted once
        self._signals = sorted(s for task, s in self._tables if task is None)
        self._tasks = sorted({task for task, _ in self._tables if task is not None})

    @property
    def signals(self) -> list[str]:
        """The signals the served mix's curves describe."""
        return list(self._signals)

    @property
    def tasks(self) -> list[str]:
        """The tasks with curves of their own."""
        return list(self._tasks)

    def task_size(self, task: str | None) -> int:
        """How many profiling requests `task`'s curves (None: the served mix's) were measured on."""
        return self._sizes.get(task, 0)

    def anchors(self, signal: str) -> list[int]:
        """The served mix's anchor rank depths of `signal`."""
        return [int(d) for d in self._tables[(None, signal)][0]] if (None, signal) in self._tables else []

    def cdf(self, signal: str, rank_depth: float, task: str | None = None) -> np.ndarray:
        """Pass probability on COVERAGE_GRID [21] at `rank_depth` (`task`'s own curves if any, and
        if they reach that shallow: rank depth 1 is another plan family, never extrapolated)."""
        key = (task, signal) if (task, signal) in self._tables else (None, signal)
        if key[0] is not None and rank_depth < self._tables[key][0][0] and (None, signal) in self._tables:
            key = (None, signal)
        if key not in self._tables:
            raise ProfileError(f"the profile has no demand distribution for signal {signal!r}; "
                               f"it has {', '.join(self.signals) or 'none'}")
        depths, cdf = self._tables[key]
        if rank_depth <= depths[0]:
            return cdf[0]
        if rank_depth >= depths[-1]:
            return cdf[-1]
        hi = int(np.searchsorted(depths, rank_depth))
        f = (rank_depth - depths[hi - 1]) / (depths[hi] - depths[hi - 1])
        return (1 - f) * cdf[hi - 1] + f * cdf[hi]

    def pass_probability(self, signal: str, rank_depth: float, coverages, task: str | None = None) -> np.ndarray:
        """P(pass) at arbitrary coverages: the step CDF read at the 5% grid point at or below."""
        return read_at(self.cdf(signal, rank_depth, task), coverages)

    def quantile(self, signal: str, rank_depth: float, q: float, task: str | None = None) -> float:
        """Smallest grid coverage passing at least a fraction q of requests (inf if none)."""
        cdf = self.cdf(signal, rank_depth, task)
        hits = np.nonzero(cdf >= q - 1e-9)[0]
        return float(COVERAGE_GRID[hits[0]]) if hits.size else float("inf")
