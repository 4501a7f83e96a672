"""The last-layer family (qci_last, 1, L - 1), FusionRAG's ranking after WarmUp layer 0: planned
only where the profile holds its demand, always as (1, L - 1), priced as it runs."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from tests.planner.synthetic_profile import demand_curve, make_profile

L = 30


def with_last(median: float):
    profile = make_profile(num_layers=L)
    return replace(profile, demand=profile.demand + (demand_curve("qci_last", L, median),))


def reqs():
    return [PlanRequest(1500, 40, 0), PlanRequest(900, 30, 0)]


def test_without_its_demand_the_family_is_never_a_candidate():
    planner = Planner(make_profile(num_layers=L))
    assert "qci_last" not in planner.candidate_signals(reqs())
    shape = planner.shape(reqs())
    for frac in (0.2, 0.5, 0.9):
        floor, saturation = planner.band(shape, "kv_dev")
        assert planner.plan(reqs(), floor + frac * (saturation - floor)).signal != "qci_last"


def test_where_it_needs_the_least_coverage_it_is_planned_as_1_and_L_minus_1():
    planner = Planner(with_last(0.02))  # passes at far less coverage than either other signal
    assert "qci_last" in planner.candidate_signals(reqs())
    assert planner.signal_depths("qci_last") == [L] and planner.signal_pairs("qci_last", L) == ((1, L - 1),)
    shape = planner.shape(reqs())
    floor, saturation = planner.band(shape, "qci_last")
    budget = floor + 0.5 * (saturation - floor)
    plan = planner.plan(reqs(), budget)
    assert (plan.signal, plan.warmup, plan.probe, plan.status) == ("qci_last", 1, L - 1, "planned")
    model = float(planner.cost.ttft(shape, "qci_last", 1, L - 1, np.array(plan.coverages))[0])
    assert plan.predicted_ttft_s == pytest.approx(model, rel=1e-9) and plan.predicted_ttft_s <= budget
    assert plan.recompute_config().label().startswith(f"(qci_last,1,{L - 1},")


def test_its_static_plans_keep_its_own_split():
    planner = Planner(with_last(0.3), PlannerConfig(signal="qci_last"))
    shape = planner.shape(reqs())
    floor, saturation = planner.band(shape, "qci_last")
    for budget, status in ((0.5 * floor, "below_floor"), (3 * saturation, "above_saturation")):
        plan = planner.plan(reqs(), budget)
        assert (plan.status, plan.warmup, plan.probe) == (status, 1, L - 1)
    # its band is its own plan's: (1, L - 1) at r_min and r_max
    lo, hi = (float(planner.cost.ttft(shape, "qci_last", 1, L - 1, np.full(2, r))[0])
              for r in (planner.config.r_min, planner.config.r_max))
    assert (floor, saturation) == pytest.approx((lo, hi), rel=1e-9)
