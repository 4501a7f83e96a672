"""The runtime monitor on a fake clock: it cuts coverage for a sustained slowdown, not for one
noisy layer, not for the cost of its own cut, and lets a late batch use the scheduler's limit."""
from __future__ import annotations

import numpy as np
import pytest

from cachesmith.planner import Planner, PlanRequest
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.recompute.hooks import LayerInfo
from tests.planner.synthetic_profile import make_profile


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def planned_batch(budget_fraction: float = 0.6):
    planner = Planner(make_profile())
    reqs = [PlanRequest(2048, 32, 0, 0.3), PlanRequest(2048, 32, 0, 0.3)]
    shape = planner.shape(reqs)
    floor, saturation = planner.band(shape, "kv_dev")
    plan = planner.plan(reqs, floor + budget_fraction * (saturation - floor))
    assert plan.status == "planned" and max(plan.coverages) > 0
    return planner, plan, shape


def durations(planner, plan, shape, coverages) -> np.ndarray:
    """Each step's seconds as the cost model prices it at `coverages` [num_steps]."""
    _, ends = planner.cost.schedule(shape, plan.signal, plan.warmup, plan.probe, np.asarray(coverages, float))
    return np.diff(ends[:, 0], prepend=0.0)


def run(planner, plan, shape, slowdown, extra=lambda j, cuts: 0.0, **kwargs):
    """Walk the plan's steps on a fake clock: step j takes the model's seconds at the current
    coverages x slowdown(j), plus extra(j, cuts). A cut re-prices the later steps, as on the
    runner. Returns (monitor, end, steps at which it cut, the pace after each step)."""
    clock = Clock()
    monitor = RuntimeMonitor(plan, planner.cost, shape, steps_done=1, clock=clock, **kwargs)
    monitor.start(at=0.0)
    seconds = durations(planner, plan, shape, plan.coverages)
    clock.now = float(seconds[0])
    cuts, paces = [], []
    for j in range(1, len(monitor.steps)):
        monitor.before_layer(j, "patch")
        clock.now += float(seconds[j]) * slowdown(j) + extra(j, cuts)
        kind = monitor.steps[j].kind
        lowered = monitor.after_layer(LayerInfo(j, "patch" if "patch" in kind else kind, 0, 0))
        if lowered:
            cuts.append(j)
            seconds[j + 1:] = durations(planner, plan, shape, monitor.coverages)[j + 1:]
        paces.append(monitor.layer_pace)
    return monitor, clock.now, cuts, paces


def test_one_slow_layer_on_an_on_time_batch_cuts_nothing():
    planner, plan, shape = planned_batch()
    # the plan's own slack, then one layer 40% over: a single noisy layer, the rest on pace
    monitor, end, cuts, _ = run(planner, plan, shape, lambda j: 1.4 if j == 10 else 1.0)
    assert cuts == [] and np.allclose(monitor.coverages, plan.coverages)
    assert end <= plan.budget_s * 1.05


def test_a_sustained_slowdown_is_cut_to_fit_the_budget():
    planner, plan, shape = planned_batch()
    slow = lambda j: 1.0 if j < 8 else 1.6  # noqa: E731
    uncut, late, *_ = run(planner, plan, shape, slow, tolerance=1e9)  # a monitor that never cuts
    assert uncut.num_replans == 0 and late > plan.budget_s * 1.05
    monitor, end, cuts, _ = run(planner, plan, shape, slow)
    assert cuts and monitor.coverages.max() < max(plan.coverages)
    assert end <= plan.budget_s * 1.1, (end, plan.budget_s)


def test_the_layer_after_a_cut_is_not_read_as_pace():
    planner, plan, shape = planned_batch()
    slow = lambda j: 1.0 if j < 8 else 1.6  # noqa: E731
    # the layer after each cut also loads the dropped rows: a one-off 0.3 s (5% of the budget)
    monitor, _, cuts, paces = run(planner, plan, shape, slow, lambda j, cuts: 0.3 if cuts and j == cuts[-1] + 1 else 0.0)
    assert cuts, "the slowdown was never cut"
    # the pace never reads the one-off layer: it stays at the lasting 1.6x (with its prior)
    assert max(paces) <= 1.6 + 1e-9
    assert monitor.num_replans <= 2, cuts


def test_the_limit_lets_a_late_batch_keep_its_coverage():
    planner, plan, shape = planned_batch()
    slow = lambda j: 1.0 if j < 8 else 1.3  # noqa: E731
    budget_only, end_b, cuts_b, _ = run(planner, plan, shape, slow)
    assert cuts_b, "without a limit the slowdown is cut to the budget"
    with_limit, end_l, cuts_l, _ = run(planner, plan, shape, slow, limit_s=plan.budget_s * 1.6)
    assert with_limit.coverages.min() > budget_only.coverages.min()
    assert end_l <= plan.budget_s * 1.6  # it still ends inside the limit


def test_the_tail_after_the_layers_is_kept_clear_of_the_limit():
    planner, plan, shape = planned_batch()
    slow = lambda j: 1.0 if j < 8 else 1.6  # noqa: E731
    limit, tail = plan.budget_s * 1.3, plan.budget_s * 0.1
    monitor, end, _, _ = run(planner, plan, shape, slow, limit_s=limit, tail_s=tail)
    assert monitor.walk_s == pytest.approx(end)  # what the executor subtracts from the batch's TTFT
    assert end <= limit - tail  # the layers end where the head and first tokens still fit
    _, end_no_tail, _, _ = run(planner, plan, shape, slow, limit_s=limit)
    assert limit - tail < end_no_tail <= limit  # without the reserve the same batch runs into it
    reserved = RuntimeMonitor(plan, planner.cost, shape, limit_s=10.0, margin=0.1, tail_s=0.5)
    assert reserved.target_s(9.0) == pytest.approx(9.5 - 0.1 * 0.5)
    # a tail that leaves less than the budget never lowers the target below it
    assert RuntimeMonitor(plan, planner.cost, shape, limit_s=plan.budget_s * 1.1,
                          tail_s=plan.budget_s * 0.2).target_s(0.0) == plan.budget_s


def test_the_tolerance_never_carries_a_batch_past_the_limit():
    planner, plan, shape = planned_batch()
    slow = lambda j: 1.0 if j < 8 else 1.3  # noqa: E731
    _, end_uncut, _, _ = run(planner, plan, shape, slow, tolerance=1e9)  # a monitor that never cuts
    limit = end_uncut / 1.02  # uncut, the batch ends 2% past the limit: inside the 5% tolerance
    assert end_uncut < limit + 0.05 * plan.budget_s
    monitor, end, cuts, _ = run(planner, plan, shape, slow, limit_s=limit, margin=0.0)
    assert cuts and end <= limit, (end, limit)
    assert monitor.tolerated_s(0.5 * limit) == pytest.approx(min(0.5 * limit + 0.05 * plan.budget_s, limit))
    free = RuntimeMonitor(plan, planner.cost, shape)  # no limit: the plain tolerance
    assert free.tolerated_s(plan.budget_s) == pytest.approx(1.05 * plan.budget_s)


def test_target_starts_at_the_margin_and_nears_the_limit_as_the_batch_runs():
    planner, plan, shape = planned_batch()
    monitor = RuntimeMonitor(plan, planner.cost, shape, limit_s=10.0, margin=0.1)
    assert monitor.target_s(0.0) == pytest.approx(max(plan.budget_s, 9.0))
    assert monitor.target_s(9.0) == pytest.approx(9.9)
    assert RuntimeMonitor(plan, planner.cost, shape).target_s(5.0) == plan.budget_s
    # a limit below the budget never lowers the target
    assert RuntimeMonitor(plan, planner.cost, shape, limit_s=plan.budget_s / 2).target_s(0.0) == plan.budget_s
