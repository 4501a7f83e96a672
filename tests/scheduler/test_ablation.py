"""The component ablation's schedulers and the planner's fixed signal (synthetic profile, no timing)."""
from __future__ import annotations

import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.recompute import preset
from cachesmith.scheduler import FcfsPlanned, FcfsSloBudget, FcfsStatic, QueuedRequest, SchedulerConfig
from tests.planner.synthetic_profile import make_profile


@pytest.fixture(scope="module")
def planner():
    return Planner(make_profile())


def test_planner_alone_runs_arrival_batches_under_the_presets_own_ttft(planner):
    plan = preset("cacheblend", 0.15, 30)
    queue = [QueuedRequest(i, 3.0 - i, 10.0, 800 + 100 * i, 32) for i in range(3)]  # the last arrived first
    cfg = SchedulerConfig(max_batch_size=2)
    d = FcfsPlanned(plan, planner.cost, cfg).next_batch(queue, 5.0)
    static = FcfsStatic(plan, planner.cost, cfg).next_batch(queue, 5.0)
    assert d.mode == "planned" and d.request_ids == (2, 1) == static.request_ids
    assert d.budget_s == pytest.approx(static.budget_s)


def test_slo_budget_fills_the_band_up_to_the_deadline(planner):
    sched = FcfsSloBudget(planner, SchedulerConfig(safety_margin=0.0))
    r = QueuedRequest(0, 0.0, 100.0, 1000, 32)
    floor, saturation = sched.bands.band([r])
    loose = sched.next_batch([r], 0.0)
    assert loose.mode == "planned" and loose.budget_s == pytest.approx(saturation)
    tight = QueuedRequest(0, 0.0, (floor + saturation) / 2, 1000, 32)
    d = sched.next_batch([tight], 0.0)
    assert floor <= d.budget_s <= tight.slo_s + 1e-9 and d.budget_s > floor
    doomed = sched.next_batch([QueuedRequest(0, 0.0, 0.5 * floor, 1000, 32)], 0.0)
    assert doomed.budget_s == pytest.approx(floor)  # nothing fits: the floor, not less


def test_slo_budget_leaves_room_for_the_waiting_queue(planner):
    sched = FcfsSloBudget(planner, SchedulerConfig(max_batch_size=1, safety_margin=0.0))
    first = QueuedRequest(0, 0.0, 100.0, 1000, 32)
    floor, saturation = sched.bands.band([first])
    alone = sched.next_batch([first], 0.0).budget_s
    # a later arrival that makes it only if the first batch ends near its floor
    waiting = QueuedRequest(1, 0.1, floor + sched.bands.floor(QueuedRequest(1, 0, 1, 1000, 32)) * 1.05, 1000, 32)
    d = sched.next_batch([first, waiting], 0.1)
    assert d.request_ids == (0,) and d.expected_on_time == 2
    assert d.budget_s < alone and d.budget_s + 0.1 + sched.bands.floor(waiting) <= waiting.deadline_s


def test_a_fixed_signal_overrides_the_entropy_vote():
    profile = make_profile()
    reqs = [PlanRequest(1000, 32, 0, 0.99), PlanRequest(900, 32, 0, 0.95)]  # high entropy: kv_dev by vote
    assert Planner(profile).choose_signal(reqs) == "kv_dev"
    fixed = Planner(profile, PlannerConfig(signal="qci"))
    assert fixed.choose_signal(reqs) == "qci" and fixed.plan(reqs, 5.0).signal == "qci"
    with pytest.raises(ConfigError, match="signal='position'"):
        PlannerConfig(signal="position")
