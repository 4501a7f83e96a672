"""The layer walk of a plan in closed form, written once per signal as a program of runs.

A plan is a few runs of identical layer passes (WarmUp, Probe, Patch), and over m identical passes
of compute c whose loads of b seconds each are queued at once on a link free at time a, the last
pass ends at max(t + m*c, a + b + c + (m - 1) * max(b, c)). `PROGRAMS` holds each signal's runs
(the runner's order, `cost_model.execution_steps`; tests hold the two equal).

In: a signal's program, each run's pass count for WarmUp w and probe p layers (`run_counts`: [J, 1]
for many pairs; one pair's as floats), every pass kind's seconds and every load's link seconds, and
the batch's start. Out: when the last pass ends: `walk_arrays` broadcasts numpy arrays ([J, 1]
counts against [1, K] costs: TTFT [J, K]); `walk_one` walks Python floats, for the single plans a
decision checks, with the same float operations in the same order, so both give the same bits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Run:
    """count(w, p, L) identical passes of one kind, each loading `load` over the link (if any)."""
    count: Callable
    key: tuple[str, bool]  # (pass kind, whether it places cached rows)
    load: str | None = None
    # when its loads may start: None at once, "selection" once the selection ended, "now" once the
    # previous run ended (it selected inside its last pass)
    ready: str | None = None


@dataclass(frozen=True)
class Select:
    """The selection between passes (ranking, row loads, Patch row plans); `count` 0 or 1 of
    (w, p, L) where a plan may skip it, None: always."""
    count: Callable | None = None


WARMUP = Run(lambda w, p, L: w, ("full", False))
ONE = lambda w, p, L: np.ones_like(w)  # noqa: E731
PATCH, PATCH_UNPLACED = ("patch", True), ("patch", False)
PROGRAMS: dict[str, tuple[Run | Select, ...]] = {
    # Patch over the probe layers places nothing (the probe did)
    "qci": (WARMUP, Run(lambda w, p, L: p, ("qci_probe", True), "full"), Select(),
            Run(lambda w, p, L: p, PATCH_UNPLACED), Run(lambda w, p, L: L - w - p, PATCH, "reused", "selection")),
    # selects inside its scoring pass
    "kv_dev": (WARMUP, Run(lambda w, p, L: p, ("full", True), "full"),
               Run(lambda w, p, L: (w + p < L).astype(float), ("score_patch", True), "full"),
               Run(lambda w, p, L: np.maximum(L - w - p - 1, 0), PATCH, "reused", "now")),
    "qci_last": (WARMUP, Run(lambda w, p, L: L - 1 - w, ("query_only", True), "prefix"),
                 Run(ONE, ("qci_probe", True), "full"), Select(),
                 Run(lambda w, p, L: L - 1 - w, PATCH, "reused", "selection"), Run(ONE, PATCH_UNPLACED)),
    # qci_last's probe, then kv_dev's scoring pass at w selects
    "fused": (WARMUP, Run(lambda w, p, L: L - 1 - w, ("query_only", True), "prefix"),
              Run(ONE, ("qci_probe", True), "full"), Run(ONE, ("score_patch", True), "full"),
              Run(lambda w, p, L: np.maximum(L - 2 - w, 0), PATCH, "reused", "now"), Run(ONE, PATCH_UNPLACED)),
    # Patch from w, selection known at once
    "position": (WARMUP, Select(lambda w, p, L: L - w > 0),
                 Run(lambda w, p, L: L - w, PATCH, "reused", "selection")),
}


def program(signal: str) -> tuple[Run | Select, ...]:
    return PROGRAMS.get(signal, PROGRAMS["position"])


@dataclass(frozen=True)
class Count:
    """One step's pass counts over many plans, with what `_run` derives from them (a split table
    keeps these, so a decision does not derive them again)."""
    m: np.ndarray  # [J, 1] (or [1, C])
    less_one: np.ndarray  # m - 1
    busy: np.ndarray | None  # m > 0; None where every plan runs the step

    @classmethod
    def of(cls, m: np.ndarray) -> "Count":
        busy = m > 0
        return cls(m, m - 1, None if busy.all() else busy)


def run_counts(signal: str, w, p, L: int) -> tuple[Count | None, ...]:
    """Each step's counts in `signal`'s program of WarmUp w and probe p layers (float arrays);
    None: a selection that always runs."""
    return tuple(None if step.count is None else Count.of(step.count(w, p, L)) for step in program(signal))


def _run(t, link, m: Count, c, b=None, ready=None):
    """(end of compute, link free time) after m identical passes; m is [J, 1], c and b [J|1, K].
    No `ready`: the link is free when it is (it never runs ahead of time 0)."""
    if b is None:
        return t + m.m * c, link
    a = link if ready is None else np.maximum(link, ready)
    end = np.maximum(t + m.m * c, a + b + c + m.less_one * np.maximum(b, c))
    if m.busy is None:  # the where's below would keep every entry
        return end, a + m.m * b
    return np.where(m.busy, end, t), np.where(m.busy, a + m.m * b, link)


def _run_one(t: float, link: float, m: float, c: float, b: float | None = None, ready: float | None = None):
    """`_run` of one plan, on floats."""
    if b is None:
        return t + m * c, link
    a = link if ready is None else max(link, ready)
    end = max(t + m * c, a + b + c + (m - 1) * max(b, c))
    return (end, a + m * b) if m > 0 else (t, link)


def _walk(steps, counts, compute: Callable, load: Callable, t, run: Callable, scale: Callable):
    link, selection = 0.0, None  # the link is idle, nothing selected yet
    for step, m in zip(steps, counts):
        if isinstance(step, Select):
            select = compute(("select", True))
            selection, t = t, t + (select if m is None else select * scale(m))
            continue
        ready = None if step.ready is None else selection if step.ready == "selection" else t
        t, link = run(t, link, m, compute(step.key), None if step.load is None else load(step.load), ready)
    return t


def walk_arrays(signal: str, counts: tuple[Count | None, ...], compute: Callable, load: Callable,
                start: np.ndarray) -> np.ndarray:
    """When the last pass ends, broadcast over counts [J, 1] (or [1, C]) and costs [1, K]; `compute`
    maps a pass key to its seconds, `load` a load to its link seconds."""
    return _walk(program(signal), counts, compute, load, start, _run, lambda m: m.m)


def walk_one(signal: str, counts: tuple[float | None, ...], seconds: dict, loads: dict, start: float) -> float:
    """When the last pass of one plan ends, from floats: its counts, each pass key's seconds and
    each load's link seconds."""
    return _walk(program(signal), counts, seconds.__getitem__, loads.__getitem__, start, _run_one, float)
