"""The fixed-split families (qci_last, 1, L - 1), FusionRAG's ranking after WarmUp layer 0, and
(fused, 1, L - 1), that ranking interleaved with KV deviation's: planned only where the profile
holds their demand (fused only when the planner's signal is fixed to it), always as (1, L - 1),
priced as they run."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from tests.planner.synthetic_profile import demand_curve, make_profile

L = 30


FIXED = pytest.mark.parametrize("signal", ["qci_last", "fused"])


def with_fixed(signal: str, median: float):
    profile = make_profile(num_layers=L)
    return replace(profile, demand=profile.demand + (demand_curve(signal, L, median),))


def reqs():
    return [PlanRequest(1500, 40, 0), PlanRequest(900, 30, 0)]


@FIXED
def test_without_its_demand_the_family_is_never_a_candidate(signal):
    planner = Planner(make_profile(num_layers=L))
    assert signal not in planner.candidate_signals(reqs())
    shape = planner.shape(reqs())
    for frac in (0.2, 0.5, 0.9):
        floor, saturation = planner.band(shape, "kv_dev")
        assert planner.plan(reqs(), floor + frac * (saturation - floor)).signal != signal


def test_the_fused_family_is_searched_only_when_fixed():
    planner = Planner(with_fixed("fused", 0.02))
    assert "fused" not in planner.candidate_signals(reqs())
    assert Planner(with_fixed("fused", 0.02), PlannerConfig(signal="fused")).candidate_signals(reqs()) == ["fused"]


@FIXED
def test_where_it_needs_the_least_coverage_it_is_planned_as_1_and_L_minus_1(signal):
    # passes at far less coverage than either other signal (fused is searched only when fixed)
    planner = Planner(with_fixed(signal, 0.02), PlannerConfig(signal="fused" if signal == "fused" else None))
    assert signal in planner.candidate_signals(reqs())
    assert planner.signal_depths(signal) == [L] and planner.signal_pairs(signal, L) == ((1, L - 1),)
    shape = planner.shape(reqs())
    floor, saturation = planner.band(shape, signal)
    budget = floor + 0.5 * (saturation - floor)
    plan = planner.plan(reqs(), budget)
    assert (plan.signal, plan.warmup, plan.probe, plan.status) == (signal, 1, L - 1, "planned")
    model = float(planner.cost.ttft(shape, signal, 1, L - 1, np.array(plan.coverages))[0])
    assert plan.predicted_ttft_s == pytest.approx(model, rel=1e-9) and plan.predicted_ttft_s <= budget
    assert plan.recompute_config().label().startswith(f"({signal},1,{L - 1},")


@FIXED
def test_its_static_plans_keep_its_own_split(signal):
    planner = Planner(with_fixed(signal, 0.3), PlannerConfig(signal=signal))
    shape = planner.shape(reqs())
    floor, saturation = planner.band(shape, signal)
    for budget, status in ((0.5 * floor, "below_floor"), (3 * saturation, "above_saturation")):
        plan = planner.plan(reqs(), budget)
        assert (plan.status, plan.warmup, plan.probe) == (status, 1, L - 1)
    # its band is its own plan's: (1, L - 1) at r_min and r_max
    lo, hi = (float(planner.cost.ttft(shape, signal, 1, L - 1, np.full(2, r))[0])
              for r in (planner.config.r_min, planner.config.r_max))
    assert (floor, saturation) == pytest.approx((lo, hi), rel=1e-9)
