"""Clocks of the serving loop: `live` follows the wall clock (the server);
`replay` is virtual, advanced by each batch's measured execution time, so a trace of arrivals
replays faithfully however long the machine takes between batches (decode, scoring and logging
run off the clock, as under prefill-decode disaggregation). The simulator's clock advances by
the cost model instead.
"""
from __future__ import annotations

import time
from typing import Protocol

from cachesmith.errors import ConfigError


class Clock(Protocol):
    name: str

    def now(self) -> float: ...

    def advance(self, seconds: float) -> None:
        """A batch (or a decision) took `seconds` of serving time."""

    def wait_until(self, t: float) -> None:
        """Idle until time `t` (the next arrival)."""


class LiveClock:
    name = "live"

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def advance(self, seconds: float) -> None:
        return None  # the wall clock moved by itself

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class ReplayClock:
    name = "replay"

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._now += seconds

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)


CLOCKS = {"live": LiveClock, "replay": ReplayClock}


def make_clock(name: str) -> Clock:
    if name not in CLOCKS:
        raise ConfigError(f"clock={name!r}: must be one of {', '.join(CLOCKS)}")
    return CLOCKS[name]()
