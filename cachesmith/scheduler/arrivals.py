"""The recent arrival process as the scheduler sees it: when the next request is likely to come and
what it will need once it is here.

In: each queued request the first time the scheduler sees it (arrival time, SLO, saturation budget
alone). Out: the predicted gap to the next arrival and the typical request's (SLO, saturation).

Why: the paper's queue model counts only requests already waiting, so a batch that finds the queue
empty may spend its whole deadline past saturation. Under bursty arrivals the request that ends a
quiet spell is usually the first of a burst, and the burst then queues behind that batch. The gap
is predicted from the measured inter-arrival times, conditioned on the time already elapsed since
the last arrival (a renewal view: it needs no assumption about the arrival distribution).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cachesmith.errors import ConfigError


@dataclass
class ArrivalHistory:
    max_requests: int = 64  # the window: the process drifts, so old arrivals stop counting
    min_requests: int = 8  # below this, no prediction (the scheduler falls back to the paper's rule)
    quantile: float = 0.5  # of the conditional next gap: the median arrival, not the mean's long tail
    _seen: dict[int, tuple[float, float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.min_requests < 2 or self.max_requests < self.min_requests:
            raise ConfigError(f"need 2 <= min_requests ({self.min_requests}) <= max_requests ({self.max_requests})")
        if not 0 < self.quantile < 1:
            raise ConfigError(f"quantile={self.quantile} must be in (0, 1)")

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, request_id: int, arrival_s: float, slo_s: float, saturation_s: float) -> None:
        if request_id in self._seen:
            return
        self._seen[request_id] = (arrival_s, slo_s, saturation_s)
        while len(self._seen) > self.max_requests:
            self._seen.pop(next(iter(self._seen)))  # dicts keep insertion order: the oldest seen

    def next_gap(self, now: float) -> float:
        """Seconds from `now` to the predicted next arrival: the quantile of the measured gaps that
        are longer than the time since the last arrival, less that time. inf when too few arrivals
        were seen or no gap was ever that long (a quiet spell longer than any before)."""
        if len(self._seen) < self.min_requests:
            return float("inf")
        arrivals = np.sort([a for a, _, _ in self._seen.values()])  # [N]
        elapsed = max(now - float(arrivals[-1]), 0.0)
        gaps = np.diff(arrivals)  # [N - 1]
        alive = gaps[gaps > elapsed]
        if alive.size == 0:
            return float("inf")
        return float(np.quantile(alive - elapsed, self.quantile))

    def typical(self) -> tuple[float, float]:
        """(SLO, saturation budget) of the typical recent request: the medians."""
        if not self._seen:
            raise ConfigError("no arrival observed yet")
        values = np.array(list(self._seen.values()))  # [N, 3]
        return float(np.median(values[:, 1])), float(np.median(values[:, 2]))
