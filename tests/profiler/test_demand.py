"""The demand profiler's passing interval per request, against known verdict curves (no model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cachesmith.planner.profile import NEVER
from cachesmith.profiler.demand import GRID_STEPS, DemandProfiler, task_curves
from cachesmith.recompute import RecomputeConfig


class FakeProfiler(DemandProfiler):
    """Verdicts from `curve(coverage)`; full prefill's is `curve(1.0)`. Counts evaluations."""

    def __init__(self, curve) -> None:
        self.pipe = SimpleNamespace(model=SimpleNamespace(num_layers=30))
        self.curve, self.calls = curve, []

    def evaluate(self, inst, plan: RecomputeConfig, tag: str) -> dict:
        self.calls.append(plan.coverage)
        return {"passed": self.curve(plan.coverage)}


@pytest.mark.parametrize("curve, interval", [
    (lambda r: r >= 0.35 - 1e-9, (0.35, NEVER)),  # the usual flip: from its demand on
    (lambda r: True, (0.0, NEVER)),  # full reuse passes already
    (lambda r: False, (NEVER, NEVER)),  # nothing passes
    (lambda r: r < 0.4 - 1e-9, (0.0, 0.4)),  # full prefill fails it; below 40% it passes
])
def test_pass_interval_finds_where_the_verdict_flips_either_way(curve, interval):
    profiler = FakeProfiler(curve)
    assert profiler.pass_interval(None, "qci", 6) == pytest.approx(interval)
    assert len(profiler.calls) <= 2 + GRID_STEPS.bit_length()  # binary search, not a sweep


def test_task_curves_keep_until_only_where_a_request_fails_again():
    demands = {("kv_dev", 2): [0.1, 0.0, None, 0.2]}
    curves = task_curves(demands, ["pr", "vt", "pr", "vt"], {("kv_dev", 2): [NEVER, 0.3, None, NEVER]})
    by = {c.task: c for c in curves}
    assert by[None].demands == (0.1, 0.0, 0.2) and by[None].until == (NEVER, 0.3, NEVER)
    assert by["pr"].demands == (0.1,) and by["pr"].until is None  # none of its requests fails again
    assert by["vt"].until == (0.3, NEVER)
    assert task_curves(demands, ["pr"] * 4)[0].until is None  # no `until` given: none fails again
