"""Which profile serves, rescaling one to this machine's speed, and the profile a model nobody
profiled gets at its first start."""
from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import pytest

from cachesmith.planner import BatchShape, Planner, PlanRequest, Profile
from cachesmith.planner.cost_model import CostModel
from cachesmith.planner.profile import PhaseCost
from cachesmith.calibration import packaged
from cachesmith.calibration.mapped_demand import REFERENCE_PROFILE, read_demand_source
from cachesmith.calibration.packaged import calibrate, rescaled
from cachesmith.calibration.cost_run import ProfileConfig
from cachesmith.recompute.config import cacheblend, epic
from tests.engine_helpers import save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # the tiny chat model borrows the packaged tokenizer


def test_rescaling_scales_every_compute_prediction():
    profile = make_profile()
    shape = BatchShape((1500, 700), (40, 30), (24, 24))
    base = CostModel(profile).full_prefill_ttft(shape)
    assert math.isclose(CostModel(rescaled(profile, 2.5)).full_prefill_ttft(shape), 2.5 * base, rel_tol=1e-12)
    with pytest.raises(ValueError, match="positive"):
        rescaled(profile, 0.0)


def test_two_factors_scale_full_layers_and_the_reuse_path_apart():
    profile = make_profile()
    shape = BatchShape((1500, 700), (40, 30), (24, 24))
    cov = [0.15, 0.15]

    def ttft(p, plan):
        return float(CostModel(p).ttft(shape, plan.signal.value, plan.warmup, plan.probe, cov)[0])
    both = rescaled(profile, 2.0, 3.0)
    # full prefill's layer passes are all full ones: without the per-batch overhead (a reuse-path
    # cost), it moves with the first factor alone
    bare = replace(profile, overhead=PhaseCost(0.0, 0.0, 0.0, 0.0, 0.0))
    full = CostModel(bare).full_prefill_ttft(shape)
    assert math.isclose(CostModel(rescaled(bare, 2.0, 3.0)).full_prefill_ttft(shape), 2.0 * full, rel_tol=1e-12)
    overhead = CostModel(profile).full_prefill_ttft(shape) - full
    assert overhead > 0
    assert math.isclose(CostModel(both).full_prefill_ttft(shape), 2.0 * full + 3.0 * overhead, rel_tol=1e-12)
    # EPIC runs no full-layer pass: all of it moves with the reuse factor
    assert math.isclose(ttft(both, epic(0.15)), 3.0 * ttft(profile, epic(0.15)), rel_tol=1e-12)
    # CacheBlend's warm-up layer is a full one: between the two
    blend = ttft(profile, cacheblend(0.15))
    assert 2.0 * blend < ttft(both, cacheblend(0.15)) < 3.0 * blend
    assert rescaled(profile, 2.0).layer_costs == rescaled(profile, 2.0, 2.0).layer_costs
    with pytest.raises(ValueError, match="reuse factor"):
        rescaled(profile, 1.0, -1.0)


def test_calibrate_measures_finite_positive_factors(tmp_path):
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path / "m"), tmp_path / "kv")
    factors = calibrate(pipe, make_profile(num_layers=pipe.model.num_layers), context_tokens=(128, 256))
    assert all(math.isfinite(f) and f > 0 for f in (factors.full, factors.reuse))  # real runs: sane only


def test_calibrate_recovers_a_machines_three_speed_factors(tmp_path, monkeypatch):
    """On a machine priced by known costs (full-layer passes 2x the profile's, the reuse path's
    fixed work 3x, each recomputed row 5x), each timed run takes what that machine's cost model
    says: the factors come out exactly, whatever else the test machine is doing."""
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path / "m"), tmp_path / "kv")
    profile = make_profile(num_layers=pipe.model.num_layers)
    machine = CostModel(rescaled(profile, 2.0, 3.0, 5.0))
    shapes = []

    def timed_on_machine(transfer, runner, prompt, plan):
        n = prompt.num_context_tokens
        shape = BatchShape((n,), (len(prompt.suffix_ids),), (0,))
        if plan.is_full_prefill(pipe.model.num_layers):
            shapes.append(shape)
        selected = n if plan.coverage >= 1.0 else round(plan.coverage * n)
        return float(machine.ttft(shape, plan.signal.value, plan.warmup, plan.probe, [selected / n])[0]), selected

    monkeypatch.setattr(packaged, "_timed", timed_on_machine)
    factors = calibrate(pipe, profile, context_tokens=(128, 256))
    assert factors.reuse == pytest.approx(3.0, rel=1e-6)  # the probes run no full-layer pass
    assert factors.row == pytest.approx(5.0, rel=1e-6)
    ratios = [machine.full_prefill_ttft(s) / CostModel(profile).full_prefill_ttft(s) for s in shapes[1:]]  # [0]: warm-up
    assert 2.0 < factors.full < 3.0 and factors.full == pytest.approx(sum(ratios) / 2, rel=1e-9)
    slower = calibrate(pipe, rescaled(profile, 1.0, 10.0), context_tokens=(128, 256))
    assert slower.reuse == pytest.approx(0.3, rel=1e-6)  # against a profile 10x slower on the reuse path
    assert slower.row == pytest.approx(0.5, rel=1e-6)


def test_one_reuse_factor_priced_full_reuse_high_where_two_price_both_probes():
    """A machine whose recomputed rows cost 2x the profile's and the rest of the reuse path 0.8x:
    one factor fitted to EPIC's plan prices full reuse high; the two fitted price both plans."""
    profile = make_profile(num_layers=6)
    machine = CostModel(rescaled(profile, 1.0, 0.8, 2.0))
    shape = BatchShape((1024,), (32,), (0,))
    probes = [(shape, plan, c, float(machine.ttft(shape, plan.signal.value, plan.warmup, plan.probe, [c])[0]))
              for plan, c in ((packaged.FIXED_PROBE, 0.0), (packaged.REUSE_PROBE, 0.15))]
    one = packaged.reuse_ratio(profile, shape, 0.15, probes[1][3])
    reuse_at_one = CostModel(rescaled(profile, 1.0, one))
    plan = packaged.FIXED_PROBE
    assert reuse_at_one.ttft(shape, plan.signal.value, 0, 0, [0.0])[0] > 1.05 * probes[0][3]
    fixed, row = packaged.reuse_factors(profile, probes)
    assert (fixed, row) == (pytest.approx(0.8, rel=1e-6), pytest.approx(2.0, rel=1e-6))


def test_reuse_factors_fall_back_to_one_ratio_when_the_fit_is_not_positive():
    profile = make_profile(num_layers=6)
    model = CostModel(profile)
    shape = BatchShape((1024,), (32,), (0,))
    plans = ((packaged.FIXED_PROBE, 0.0), (packaged.REUSE_PROBE, 0.15))
    priced = [float(model.ttft(shape, p.signal.value, p.warmup, p.probe, [c])[0]) for p, c in plans]
    # full reuse measured slower than EPIC's plan: only a negative row cost would fit both
    probes = [(shape, plans[0][0], 0.0, priced[1] * 1.2), (shape, plans[1][0], 0.15, priced[1])]
    fixed, row = packaged.reuse_factors(profile, probes)
    assert fixed == row == pytest.approx(float(np.median([priced[1] * 1.2 / priced[0], 1.0])), rel=1e-9)


# QUICK_COSTS shrunk to a few seconds (the serve test in tests/server runs the real one)
TOY_COSTS = ProfileConfig(num_requests=1, max_tokens=512, num_shapes=3, plans_per_shape=2, num_pool_chunks=6,
                          tiers=("memory",))


@pytest.fixture(scope="module")
def unprofiled_dir(tmp_path_factory):
    """A 4-layer model of 1024 positions nothing is packaged for (saved before any test moves the home)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("unprofiled") / "tiny-unprofiled")


def test_a_model_nobody_profiled_serves_with_mapped_demand_and_costs_measured_once(unprofiled_dir, tmp_path,
                                                                                    monkeypatch, caplog):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))  # no measured profile
    pipe = tiny_pipeline(unprofiled_dir, tmp_path / "kv")
    own = tmp_path / "home" / "profiles" / "tiny-unprofiled-float32-cpu.json"
    with caplog.at_level(logging.INFO):
        profile, source = packaged.serving_profile(pipe, quick_costs=TOY_COSTS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "packaged smollm2-135m profile mapped onto this model's 4 layers" in warnings[0]
    assert f"cachesmith profile --model {unprofiled_dir} --dtype float32 --device cpu" in warnings[0]
    assert source == "measured" and profile.num_layers == 4 and Profile.load(own) == profile
    assert max(c.rank_depth for c in profile.demand) == 4 and profile.tier_gbps["memory"] > 0
    assert profile.demand == read_demand_source(REFERENCE_PROFILE).onto(4)[0]
    assert Planner(profile).plan([PlanRequest(300, 20, 0, 0.5)], 10.0).predicted_ttft_s <= 10.0

    def refuse(*args, **kwargs):
        raise AssertionError("costs measured again")

    monkeypatch.setattr(packaged, "run_costs_profile", refuse)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the next start reads the saved one, quietly
        assert packaged.serving_profile(pipe, quick_costs=TOY_COSTS) == (profile, "measured")
    assert caplog.records == []
