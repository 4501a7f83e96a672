"""Shadow calibration: the served workload's demand measured from its own requests, in idle time.

In: finished requests offered as they are served (`offer`: a seeded `fraction` of them is kept,
at most `max_pending` waiting), and idle time (`run_idle`: on the replay clock, the gap before the
next arrival; live, while the loop has nothing to run). Out: per sampled request, its passing
interval per (signal, anchor depth) (a `Sampler`'s `sample_rounds`: full prefill, then the
coverage ladder of every curve the planner prices, judged by fidelity: no labels) handed to
`sink` (the planner's `observe_sample`), and counters for `/metrics`.

The measuring is `calibration.shadow`'s (`shadow_calibrator` builds a calibrator on its
`DemandProfiler`); this module only fits it into idle time, so the serving engine runs shadow work
it is handed (`EngineConfig.shadow_work`) without importing the measuring.

Work runs in units (full prefill, or one round of the coverage searches: a few seconds on 2
cores) and a unit only starts where it fits: on the replay clock, where the gap left is at least the
longest unit seen so far (the clock then advances by the unit's time, cut at the next arrival);
live, only with nothing queued, admitted or decoding, and under the admission lock (it reads the
store), so a request arriving during a unit waits for that unit at most (`max_unit_s`, reported). TTFTs are not delayed on the replay clock (tested on a fake
clock), and the bench's replay runs keep the meaning of their numbers.
"""
from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from cachesmith.clock import Clock
from cachesmith.errors import ConfigError, InputError
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner
from cachesmith.request import Request

Intervals = dict[tuple[str, int], tuple[float, float]]


class Sampler(Protocol):
    """Measures one request's passing intervals one unit at a time (`DemandProfiler`)."""

    def sample_rounds(self, request: Request, keys: list[tuple[str, int]]
                      ) -> Generator[None, None, Intervals]: ...


@dataclass(frozen=True)
class ShadowConfig:
    fraction: float = 0.02  # of served requests shadow-evaluated
    max_pending: int = 4  # sampled requests waiting for idle time; more are dropped (counted)
    seed: int = 0
    initial_unit_s: float = 5.0  # a unit's expected time before any was measured

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ConfigError(f"fraction={self.fraction}: must be in [0, 1]")
        if self.max_pending < 1:
            raise ConfigError(f"max_pending={self.max_pending}: must be at least 1")
        if not self.initial_unit_s > 0:
            raise ConfigError(f"initial_unit_s={self.initial_unit_s}: must be > 0")


@dataclass
class ShadowStats:
    num_offered: int = 0
    num_sampled: int = 0  # kept for shadow work
    num_dropped: int = 0  # sampled while max_pending waited
    num_samples: int = 0  # measured to the end and handed to the planner
    num_skipped: int = 0  # sampled, but its stored entries were gone before it was measured
    num_units: int = 0
    seconds: float = 0.0  # time spent in shadow units
    max_unit_s: float = 0.0  # the longest unit: the most a live request waited for one


class ShadowCalibrator:
    """`profiler` measures (a `DemandProfiler` with the fidelity gate, or any `Sampler`); `timer`
    measures a unit (tests pass a fake one)."""

    def __init__(self, profiler: Sampler, keys: list[tuple[str, int]], sink: Callable[[Intervals], None],
                 config: ShadowConfig | None = None, timer: Callable[[Callable[[], None]], float] | None = None) -> None:
        self.profiler, self.keys, self.sink = profiler, keys, sink
        self.config = config or ShadowConfig()
        self.stats = ShadowStats()
        self._rng = random.Random(self.config.seed)
        self._pending: deque[Request] = deque()
        self._current: Generator[None, None, Intervals] | None = None
        self._timer = timer or _wall_time

    @property
    def has_work(self) -> bool:
        return self._current is not None or bool(self._pending)

    def offer(self, request: Request) -> bool:
        """A served request: kept for shadow work with probability `fraction`."""
        self.stats.num_offered += 1
        if self._rng.random() >= self.config.fraction:
            return False
        self.stats.num_sampled += 1
        if len(self._pending) >= self.config.max_pending:
            self.stats.num_dropped += 1
            return False
        self._pending.append(request)
        return True

    def expected_unit_s(self) -> float:
        return self.stats.max_unit_s or self.config.initial_unit_s

    def run_idle(self, clock: Clock, until_s: float | None = None) -> int:
        """Units while they fit before `until_s` (replay clock: the next arrival), advancing `clock`
        by each; with `until_s` None (live), one unit. Returns the units run."""
        num = 0
        while self.has_work and (until_s is None or clock.now() + self.expected_unit_s() <= until_s):
            seconds = self._timer(self._unit)
            self.stats.num_units += 1
            self.stats.seconds += seconds
            self.stats.max_unit_s = max(self.stats.max_unit_s, seconds)
            num += 1
            if until_s is None:
                return num
            clock.advance(min(seconds, max(0.0, until_s - clock.now())))
        return num

    def _unit(self) -> None:
        if self._current is None:
            self._current = self.profiler.sample_rounds(self._pending.popleft(), self.keys)
        try:
            next(self._current)
        except StopIteration as done:
            self._current = None
            self.stats.num_samples += 1
            self.sink(done.value)
        except InputError:  # its stored entries are gone and cannot be rebuilt: the next one is measured
            self._current = None
            self.stats.num_skipped += 1


def _wall_time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# builds a learning engine's shadow work from its pipeline, its planner and the config
ShadowFactory = Callable[[RagPipeline, Planner, ShadowConfig], ShadowCalibrator]
