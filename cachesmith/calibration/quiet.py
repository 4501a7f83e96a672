"""Timing on a shared machine: wait until it is quiet, then check the timed run stayed quiet.

On a machine whose cores another job is using, a batch's small operations wait on descheduled
threads and its passes run several times slower than alone (a 257-row Patch pass took 8-10x its
quiet time next to a 2-thread benchmark on 2 cores), so timings taken then describe the neighbour,
not the engine. `QuietRun` wraps one timed run: on entry it waits until the whole machine is at
most `max_busy` busy while this process is idle; on exit it measures how much of the machine
*other* processes used during the run (machine CPU time minus this process's, over wall time and
cores), so a run a neighbour joined halfway is known as contended and can be timed again. Linux
only (/proc/stat); elsewhere every run counts as quiet.

In: the busiest the machine may be (fraction of all cores), the longest wait. Out: per run, the
seconds waited, the other processes' share during the run, and whether it was quiet.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

STAT = Path("/proc/stat")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NUM_CPUS = os.cpu_count() or 1


def _machine() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot (None: unknown)."""
    try:
        fields = [int(x) for x in STAT.read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / TICK, sum(fields) / TICK


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def cpu_busy(window_s: float = 0.5) -> float | None:
    """Fraction of all cores busy over `window_s` (None where /proc/stat is unavailable)."""
    a = _machine()
    if a is None:
        return None
    time.sleep(window_s)
    b = _machine()
    if b is None or b[1] == a[1]:
        return None
    # clamped: the kernel's iowait counter may step backwards, pushing the raw ratio past 1
    return min(1.0, max(0.0, (b[0] - a[0]) / (b[1] - a[1])))


@dataclass(frozen=True)
class QuietWait:
    waited_s: float
    busy: float | None  # the machine's load when the wait ended (None: unknown)
    is_quiet: bool


def wait_for_quiet(max_busy: float = 0.2, window_s: float = 0.5, max_wait_s: float = 900.0,
                   consecutive: int = 2) -> QuietWait:
    """Block until `consecutive` windows in a row show at most `max_busy` of the machine in use
    (this process idle), or `max_wait_s` passed."""
    start, streak, busy = time.monotonic(), 0, None
    while True:
        busy = cpu_busy(window_s)
        if busy is None:
            return QuietWait(time.monotonic() - start, None, True)
        streak = streak + 1 if busy <= max_busy else 0
        if streak >= consecutive:
            return QuietWait(time.monotonic() - start, busy, True)
        if time.monotonic() - start >= max_wait_s:
            return QuietWait(time.monotonic() - start, busy, False)
        if streak == 0:
            time.sleep(min(5.0, window_s * 4))


class QuietRun:
    """`with QuietRun(0.15) as q: <timed run>`; then `q.is_quiet`, `q.other` (other processes'
    share of all cores during the run; None: unknown) and `q.wait`. A run is quiet when the wait
    ended quiet and others used at most `max_other` of the cores while it ran (a 12% share
    stretched a 3.4 s run to 5.0 s here)."""

    def __init__(self, max_busy: float = 0.15, max_wait_s: float = 900.0, max_other: float = 0.03) -> None:
        self.max_busy, self.max_wait_s, self.max_other = max_busy, max_wait_s, max_other
        self.wait: QuietWait | None = None
        self.other: float | None = None
        self._start = None

    def __enter__(self) -> "QuietRun":
        self.wait = wait_for_quiet(self.max_busy, max_wait_s=self.max_wait_s)
        self._start = (time.monotonic(), _machine(), _own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        t0, m0, own0 = self._start
        m1, wall = _machine(), time.monotonic() - t0
        if m0 is None or m1 is None or wall <= 0:
            return
        others = (m1[0] - m0[0]) - (_own_cpu_s() - own0)
        self.other = max(0.0, others) / (wall * NUM_CPUS)

    @property
    def is_quiet(self) -> bool:
        calm = self.other is None or self.other <= self.max_other
        return bool(self.wait is not None and self.wait.is_quiet and calm)

    def record(self) -> dict:
        return {"waited_s": self.wait.waited_s if self.wait else 0.0, "other": self.other, "is_quiet": self.is_quiet}
