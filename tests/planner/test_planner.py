"""Planner logic on a synthetic profile: band, monotonicity, link speed vs split, allocation,
bad input. The cost model's accuracy on the real model is checked in test_profiler.py."""
from __future__ import annotations

import numpy as np
import pytest

from cachesmith.errors import InputError
from cachesmith.planner import BatchPlan, BatchShape, CostModel, Planner, PlannerConfig, PlanRequest
from cachesmith.planner.allocate import allocate, expected_passes
from cachesmith.planner.grid import ttft_grid
from cachesmith.planner.planner import pick
from tests.planner.synthetic_profile import make_profile


def batch(contexts=(1024, 1024), entropy=0.3, suffix=32):
    return [PlanRequest(c, suffix, 0, entropy) for c in contexts]


@pytest.fixture(scope="module")
def planner():
    # the passes rule: these tests follow the signal the synthetic demand favours (qci) through the
    # band; the robust rule's margin is tested in test_signal_choice.py
    return Planner(make_profile(), PlannerConfig(signal_rule="passes"))


@pytest.mark.parametrize("signal", ["kv_dev", "qci", "qci_last", "fused", "position"])
def test_vectorized_grid_equals_the_layer_walk(signal):
    model = CostModel(make_profile(gbps=0.05))  # slow link: stalls shape the result
    shape = BatchShape((700, 1500), (24, 40), (16, 16))
    pairs = ((1, 1), (2, 3), (4, 1)) if signal not in ("position", "qci_last", "fused") else ((1, 0), (3, 0))
    grid = np.array([0.0, 0.05, 0.3, 1.0])
    fast = ttft_grid(model, shape, signal, pairs, grid)
    for j, (w, p) in enumerate(pairs):
        slow = model.ttft(shape, signal, w, p, np.repeat(grid[:, None], 2, axis=1))
        np.testing.assert_allclose(fast[j], slow, rtol=1e-12)


def test_full_prefill_in_closed_form_equals_the_layer_walk():
    model = CostModel(make_profile(gbps=0.05))
    for shape in (BatchShape((700, 1500), (24, 40), (16, 16)), BatchShape((0,), (1,), (0,))):
        walk = model.ttft(shape, "position", model.num_layers, 0, np.zeros(shape.num_requests))[0]
        assert model.full_prefill_ttft(shape) == pytest.approx(walk, rel=1e-12)


def test_ttft_grows_with_coverage_and_band_is_ordered(planner):
    shape = planner.shape(batch())
    t = planner.cost.ttft(shape, "qci", 2, 2, np.array([[0.0, 0.0], [0.2, 0.2], [0.8, 0.8]]))
    assert t[0] < t[1] < t[2]
    floor, saturation = planner.band(shape, "qci")
    assert 0 < floor < saturation < planner.cost.full_prefill_ttft(shape)


def test_plan_inside_the_band_meets_the_budget(planner):
    reqs = batch()
    floor, saturation = planner.band(planner.shape(reqs), "qci")
    budget = (floor + saturation) / 2
    plan = planner.plan(reqs, budget)
    assert plan.status == "planned" and plan.signal == "qci"
    assert plan.predicted_ttft_s <= budget and plan.warmup >= 1 and plan.probe >= 1
    assert len(plan.coverages) == 2 and all(0 <= c <= 1 for c in plan.coverages)
    assert 0 < plan.expected_passes <= 2


def test_outside_the_band_a_static_plan(planner):
    reqs = batch()
    floor, saturation = planner.band(planner.shape(reqs), "qci")
    low, high = planner.plan(reqs, floor * 0.5), planner.plan(reqs, saturation * 2)
    assert low.status == "below_floor" and low.coverages == (0.05, 0.05) and (low.warmup, low.probe) == (1, 1)
    assert high.status == "above_saturation" and (high.warmup, high.probe) == (1, 1)
    # budget past saturation buys coverage on the static plan, never past the budget
    assert high.coverages[0] == high.coverages[1] > 0.5 and high.predicted_ttft_s <= saturation * 2
    higher = planner.plan(reqs, saturation * 4)
    assert higher.coverages[0] >= high.coverages[0] and higher.predicted_ttft_s <= saturation * 4
    just = planner.plan(reqs, saturation * 1.0001)
    assert just.coverages == (0.5, 0.5)


def test_more_budget_never_lowers_expected_passes(planner):
    for contexts in [(1024,), (512, 2048), (256, 512, 1024, 2048)]:
        reqs = batch(contexts)
        floor, saturation = planner.band(planner.shape(reqs), "qci")
        passes = [planner.plan(reqs, b).expected_passes for b in np.linspace(floor, saturation, 15)]
        assert all(b >= a - 1e-9 for a, b in zip(passes, passes[1:])), passes
        assert passes[-1] > passes[0]


def test_signal_follows_the_entropy_majority(planner):
    assert planner.choose_signal(batch(entropy=0.9)) == "kv_dev"  # dispersed attention
    assert planner.choose_signal(batch(entropy=0.2)) == "qci"  # concentrated
    mixed = [PlanRequest(500, 20, 0, h) for h in (0.9, 0.9, 0.1)]
    assert planner.choose_signal(mixed) == "kv_dev"


def test_a_plan_that_fits_beats_one_that_does_not_whatever_it_expects():
    """A below-floor plan runs late and the runtime monitor cuts it to near full reuse: the passes
    it expected never happen, so a fitting plan wins however few it expects."""
    def plan(signal, ttft, passes):
        return BatchPlan(signal, 1, 1, (0.05,), ttft, passes, 1.0, 0.5, 2.0, "planned")
    fits, late = plan("kv_dev", 0.9, 0.2), plan("qci_last", 1.2, 0.9)
    assert pick([late, fits], budget_s=1.0) is fits
    assert pick([plan("qci", 0.8, 0.3), fits], budget_s=1.0).signal == "qci"  # both fit: more passes
    slower = plan("qci", 1.5, 0.95)
    assert pick([slower, late], budget_s=1.0) is late  # none fits: the least late


def test_the_chosen_signal_fits_a_budget_between_the_signals_floors(planner):
    reqs = batch((1024, 2048))
    shape = planner.shape(reqs)
    floors = sorted((planner.band(shape, s)[0], s) for s in planner.candidate_signals(reqs))
    assert floors[0][0] < floors[-1][0], floors  # the signals' floors differ on this profile
    budget = (floors[0][0] + floors[-1][0]) / 2
    chosen = planner.plan(reqs, budget)
    assert chosen.predicted_ttft_s <= budget and chosen.status != "below_floor"
    assert chosen.signal != floors[-1][1]


def test_a_slower_link_moves_rank_depth_from_probe_to_warmup():
    """Paper Fig. 10b: a Probe layer needs its whole KV before it runs; WarmUp needs none and
    leaves time to prefetch. On a slow link the best split of the same depth has more WarmUp."""
    profile = make_profile(kv_bytes=1536)
    fast = Planner(profile, PlannerConfig(bandwidth_gbps=10.0, num_splits=8))
    slow = Planner(profile, PlannerConfig(bandwidth_gbps=0.02, num_splits=8))
    shape = fast.shape(batch((2048, 2048)))
    budget_fast = sum(fast.band(shape, "qci")) / 2
    budget_slow = sum(slow.band(shape, "qci")) / 2
    (w_fast, p_fast), _, _ = fast.best_splits(shape, "qci", budget_fast, [8])[8]
    (w_slow, p_slow), _, _ = slow.best_splits(shape, "qci", budget_slow, [8])[8]
    assert w_fast == 1 and p_fast == 7  # probes are cheap when KV is at hand
    assert w_slow > w_fast


def test_allocation_beats_uniform_on_a_constructed_case():
    # everyone passes at 10%; no one below. Uniform 6% over a 200- and a 2000-token request
    # passes neither; giving the short one 10% (20 tokens) and the long one the rest passes one.
    cdf = [0.0, 0.0, 1.0] + [1.0] * 18
    ctx = [200, 2000]
    budget = 0.06 * sum(ctx)
    uniform = [0.05, 0.05]
    alloc = allocate(ctx, budget, cdf)
    assert sum(c * n for c, n in zip(alloc, ctx)) <= budget + 1e-9
    assert expected_passes(alloc, cdf) == 1.0 > expected_passes(uniform, cdf)


def test_allocation_respects_the_budget_and_grows_with_it():
    rng = np.random.default_rng(0)
    for trial in range(40):
        if trial % 2:  # any CDF
            cdf = list(np.sort(rng.uniform(0, 1, 21)))
        else:  # a concave one: falling increments
            cdf = list(np.concatenate([[0], np.cumsum(np.sort(rng.uniform(0, 0.1, 20))[::-1])]))
        ctx = list(rng.integers(100, 3000, rng.integers(1, 16)))
        passes = []
        for frac in np.linspace(0, 1, 12):
            budget = frac * sum(ctx)
            alloc = allocate(ctx, budget, cdf)
            assert sum(c * n for c, n in zip(alloc, ctx)) <= budget + 1e-6
            passes.append(expected_passes(alloc, cdf))
            if trial % 2 == 0:  # on a concave curve greedy is optimal but for the one move that
                # stopped the prefix: within one grid step's gain of uniform, or better
                uniform = [int(frac / 0.05 + 1e-9) * 0.05] * len(ctx)
                assert passes[-1] >= expected_passes(uniform, cdf) - max(np.diff(cdf)) - 1e-9
        assert all(b >= a - 1e-12 for a, b in zip(passes, passes[1:]))


@pytest.mark.parametrize("budget", [-1.0, 0.0, float("nan"), "1"])
def test_bad_budget_is_named(planner, budget):
    with pytest.raises(InputError, match="budget_s"):
        planner.plan(batch(), budget)


def test_empty_batch_is_named(planner):
    with pytest.raises(InputError, match="batch is empty"):
        planner.plan([], 1.0)


def test_stalls_on_a_slow_link_are_spent_on_coverage():
    """While a Patch layer waits for its reused rows, recomputing more rows costs nothing (and
    leaves fewer to load): at the budget of (qci,1,1,5%) a transfer-bound batch affords far more."""
    shape = BatchShape.uniform(2, 2048, 32)
    for gbps, lowest in ((10.0, 0.0), (0.02, 0.3)):
        planner = Planner(make_profile(), PlannerConfig(bandwidth_gbps=gbps))
        budget = float(planner.cost.ttft(shape, "qci", 1, 1, np.array([0.05, 0.05]))[0])
        _, coverage, ttft = planner.best_splits(shape, "qci", budget, [2])[2]
        assert ttft <= budget and coverage >= max(lowest, 0.04)  # the 2% grid point at or below 5%
        if gbps > 1:
            assert coverage < 0.1  # compute-bound: no free lunch


@pytest.mark.parametrize("signal", ["kv_dev", "qci", "qci_last", "fused", "position"])
def test_summed_request_terms_price_a_batch_like_its_per_request_walk(signal):
    """Uniform-coverage pricing from summed terms (the grid, the scheduler's candidates) equals the
    walk over the batch's per-request coverage rows (the allocation check)."""
    from cachesmith.planner.grid import request_terms, ttft_rows, ttft_totals

    slow = Planner(make_profile(gbps=0.5))  # a slow link, so stalls enter the walk
    rng = np.random.default_rng(3)
    for _ in range(6):
        R = int(rng.integers(1, 6))
        c, q, p = rng.integers(100, 3000, R), rng.integers(10, 60, R), rng.integers(0, 30, R)
        shape = BatchShape(tuple(map(int, c)), tuple(map(int, q)), tuple(map(int, p)))
        totals = request_terms(c, q, p).sum(0)[None, :]
        pairs = ((1, 1), (2, 3))
        for r in (0.05, 0.5):
            want = ttft_rows(slow.cost, shape, signal, pairs, np.full((1, R), r))[:, 0]
            np.testing.assert_allclose(ttft_totals(slow.cost, signal, pairs, r, totals)[:, 0], want, rtol=1e-12)


def test_a_learned_correction_sizes_plans_for_the_measured_pace(planner):
    fresh = Planner(make_profile())
    reqs = batch()
    floor, saturation = fresh.band(fresh.shape(reqs), "qci")
    budget = floor + 0.6 * (saturation - floor)
    before = fresh.plan(reqs, budget)
    for _ in range(30):
        fresh.observe("qci", 1.25)  # QCI batches keep running 25% over the model
    assert fresh.correction["qci"] == pytest.approx(1.25, rel=1e-3)
    after = fresh.plan(reqs, budget)
    assert after.predicted_ttft_s <= budget and after.floor_s == pytest.approx(1.25 * floor, rel=1e-3)
    assert sum(after.coverages) < sum(before.coverages)  # less fits once the pace is known
    fresh.observe("qci", 50.0)  # a wild outlier is clipped, not believed
    assert fresh.correction["qci"] <= 0.7 * 1.25 + 0.3 * 2.0 + 1e-9


@pytest.mark.parametrize("signal,w,p", [("position", 0, 0), ("qci", 1, 1), ("kv_dev", 1, 1), ("qci_last", 2, 0),
                                        ("fused", 2, 0)])
def test_patch_passes_price_every_placed_cached_row_in_the_walk_and_the_grid(signal, w, p):
    """A Patch pass rotates and copies every cached row (prefix and context) into place, whatever
    the coverage: its aux feature. The closed-form grid prices it as the walk does."""
    from dataclasses import replace

    from cachesmith.planner.cost_model import execution_steps

    base = make_profile()
    priced = replace(base, layer_costs={**base.layer_costs,
                                        "patch": replace(base.layer_costs["patch"], per_aux_s=2e-6)})
    shape = BatchShape((700, 1500), (24, 40), (16, 0))
    # QCI's Patch passes over its probe layers (FusionRAG's over the last) place nothing: the probe did
    num_patch = sum(s.kind == "patch" and s.places for s in execution_steps(signal, w, p, base.num_layers))
    for r in (0.0, 0.3, 1.0):
        cov = np.array([[r, r]])
        extra = CostModel(priced, 1e9).ttft(shape, signal, w, p, cov)[0] - CostModel(base, 1e9).ttft(shape, signal, w, p, cov)[0]
        assert extra == pytest.approx(2e-6 * num_patch * (700 + 1500 + 16), rel=1e-9)
    slow = CostModel(priced, 0.05)  # with stalls in the walk too
    grid = np.array([0.0, 0.3, 1.0])
    np.testing.assert_allclose(ttft_grid(slow, shape, signal, ((w, p),), grid)[0],
                               slow.ttft(shape, signal, w, p, np.repeat(grid[:, None], 2, axis=1)), rtol=1e-12)


@pytest.mark.parametrize("signal,w,p,selects,placing", [
    ("position", 0, 0, True, {"patch": 30}), ("qci", 1, 1, True, {"qci_probe": 1, "patch": 28}),
    ("kv_dev", 1, 1, False, {"full": 1, "score_patch": 1, "patch": 27}),
    ("qci_last", 2, 0, True, {"qci_probe": 1, "patch": 27}),
    ("fused", 2, 0, False, {"qci_probe": 1, "score_patch": 1, "patch": 26}),
    ("position", 30, 0, False, {})])
def test_selection_and_placement_are_priced_where_the_runner_does_them(signal, w, p, selects, placing):
    """Every plan but kv_dev's (which selects inside its scoring pass) and full prefill pays one
    selection before its first Patch pass; each layer's cached rows are placed once, by the first
    pass that reads them (a probe's, or a Patch pass's). The grid prices both as the walk does."""
    from dataclasses import replace

    from cachesmith.planner.cost_model import execution_steps
    from cachesmith.planner.grid import ttft_grid
    from cachesmith.planner.profile import PhaseCost

    base = make_profile()
    steps = execution_steps(signal, w, p, base.num_layers)
    assert sum(s.selects for s in steps) == selects
    counts = {}
    for s in steps:
        if s.places:
            counts[s.kind] = counts.get(s.kind, 0) + 1
    assert counts == placing
    shape = BatchShape((700, 1500), (24, 40), (16, 0))
    cov = np.array([[0.2, 0.2]])
    costly = replace(base, layer_costs={**base.layer_costs, "select": PhaseCost(0.5, 0.0, 0.0)})
    gap = (CostModel(costly, 1e9).ttft(shape, signal, w, p, cov) - CostModel(base, 1e9).ttft(shape, signal, w, p, cov))[0]
    assert gap == pytest.approx((0.5 - CostModel(base).select_seconds(shape)) * selects, abs=1e-12)
    if signal == "position" and w == 30:
        return
    slow = CostModel(costly, 0.05)
    grid = np.array([0.0, 0.2, 1.0])
    np.testing.assert_allclose(ttft_grid(slow, shape, signal, ((w, p),), grid)[0],
                               slow.ttft(shape, signal, w, p, np.repeat(grid[:, None], 2, axis=1)), rtol=1e-12)
