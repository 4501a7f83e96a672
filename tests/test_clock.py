"""Clocks: replay moves only when told; live follows the wall clock."""
from __future__ import annotations

import time

import pytest

from cachesmith.clock import LiveClock, ReplayClock, make_clock
from cachesmith.errors import ConfigError


def test_replay_clock_advances_and_waits_without_sleeping():
    clock = ReplayClock()
    start = time.perf_counter()
    clock.advance(2.5)
    clock.wait_until(1.0)  # the past: no effect
    assert clock.now() == 2.5
    clock.wait_until(100.0)
    assert clock.now() == 100.0 and time.perf_counter() - start < 0.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1.0)


def test_live_clock_follows_the_wall_clock():
    clock = LiveClock()
    t0 = clock.now()
    clock.wait_until(t0 + 0.05)
    clock.advance(10.0)  # a no-op: the batch's time has passed already
    assert 0.05 <= clock.now() - t0 < 1.0


def test_unknown_clock_is_named():
    assert make_clock("replay").name == "replay"
    with pytest.raises(ConfigError, match="clock='simulated'"):
        make_clock("simulated")
