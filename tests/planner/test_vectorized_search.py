"""The planner's vectorized decision against the straightforward one it replaces: the stacked
allocation, the per-decision pricing and walks, and whole decisions (a reference search, per rank
depth and per split, on the slow primitives) give the same plans, to the bit."""
from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import pytest

from cachesmith.planner import BatchPlan, BatchShape, CostModel, Planner, PlannerConfig, PlanRequest
from cachesmith.planner.allocate import (EnvelopeTable, allocate, allocate_many, concave_envelope, expected_passes,
                                         expected_passes_many)
from cachesmith.planner.demand import read_at
from cachesmith.planner.grid import RowPricer, request_terms, ttft_grid, ttft_rows, uniform_costs
from cachesmith.planner.planner import COVERAGE_GRID, pick
from cachesmith.planner.signal_choice import Evidence, robust_pick
from cachesmith.planner.walk import run_counts, walk_one
from tests.planner.synthetic_profile import demand_curve, make_profile

SIGNALS = ("kv_dev", "qci", "qci_last", "fused", "position")


def profile_with_tasks(gbps: float = 5.0):
    """The synthetic profile plus the fixed-split signals' curves and two tasks' own curves."""
    base = make_profile(gbps=gbps)
    extra = tuple(demand_curve(s, 30, m) for s, m in (("qci_last", 0.2), ("fused", 0.15)))
    tasks = tuple(replace(demand_curve(c.signal, c.rank_depth, m), task=t)
                  for t, m in (("a", 0.1), ("b", 0.45)) for c in base.demand + extra)
    return replace(base, demand=base.demand + extra + tasks)


def random_batch(rng, theta: float, task: str | None = None) -> list[PlanRequest]:
    return [PlanRequest(int(rng.integers(0, 4097)) if rng.random() < 0.1 else int(rng.integers(256, 4097)),
                        int(rng.integers(16, 64)), int(rng.integers(0, 30)),
                        float(np.clip(theta + rng.normal(0, 0.1), 0, 1)), task)
            for _ in range(int(rng.integers(1, 17)))]


def test_stacked_allocation_equals_allocate_per_curve():
    rng = np.random.default_rng(0)
    for _ in range(50):
        cdfs = np.sort(rng.random((int(rng.integers(1, 8)), 21)), 1) * rng.random((1, 1))
        cdfs[:, rng.integers(0, 21)] -= 0.1 * rng.random()  # a dip: the envelope must not mind
        context = rng.integers(0, 4097, int(rng.integers(1, 17))) * (rng.random(1) < 0.9)
        budgets = rng.integers(0, 51, len(cdfs)) * 0.02 * context.sum()
        envelopes = [concave_envelope(cdf) for cdf in cdfs]
        got = allocate_many(context, budgets, EnvelopeTable.of(envelopes))
        want = [allocate(context, b, cdf, env) for cdf, b, env in zip(cdfs, budgets, envelopes)]
        assert got.tolist() == want
        assert expected_passes_many(got, cdfs).tolist() == [expected_passes(w, cdf) for w, cdf in zip(want, cdfs)]


@pytest.mark.parametrize("gbps", [5.0, 0.05])
def test_decision_pricing_and_walks_equal_the_grid_and_row_walks(gbps):
    model, rng = CostModel(make_profile(gbps=gbps)), np.random.default_rng(1)
    L = model.num_layers
    for _ in range(10):
        reqs = random_batch(rng, 0.5)
        shape = Planner(make_profile()).shape(reqs)
        columns = np.concatenate([COVERAGE_GRID, [0.05, 0.5]])
        costs = uniform_costs(model, request_terms(*shape.arrays()[:3]).sum(0), columns)
        pricer = RowPricer(model, shape)
        for signal in SIGNALS:
            pairs = ((1, 0), (1, 1), (2, 3), (5, 10), (1, L - 1), (L, 0))
            w, p = (np.array(x, float)[:, None] for x in zip(*pairs))
            counts = run_counts(signal, w, p, L)
            np.testing.assert_array_equal(costs.walk(signal, counts), ttft_grid(model, shape, signal, pairs, columns))
            cov = np.round(rng.integers(0, 21, (len(pairs), len(reqs))) * 0.05, 4)
            for j, (seconds, loads) in enumerate(pricer.prices(cov)):
                one = walk_one(signal, tuple(None if m is None else float(m.m[j, 0]) for m in counts), seconds, loads,
                               pricer.start)
                assert one == ttft_rows(model, shape, signal, (pairs[j],), cov[j:j + 1])[0, 0]


def reference_plan(planner: Planner, requests: list[PlanRequest], budget_s: float) -> BatchPlan:
    """The decision as the planner made it before its search was vectorized (profiled demand)."""
    shape, task = planner.shape(requests), planner.batch_task(requests)
    sized = budget_s / planner.margin()
    plans = [_reference_signal(planner, shape, s, sized, task) for s in planner.candidate_signals(requests)]
    if planner.config.signal_rule == "robust" and len(plans) > 1:
        groups = [task] if task is not None else [None, *planner.demand.tasks]
        evidence = [Evidence(t, planner.demand.task_size(t), lambda plan, t=t: read_at(
            planner.demand.cdf(plan.signal, plan.rank_depth, t), plan.coverages)) for t in groups]
        return replace(robust_pick(plans, sized, evidence, planner.config.signal_margin_z, pick), budget_s=budget_s)
    return replace(pick(plans, sized), budget_s=budget_s)


def _reference_signal(planner: Planner, shape: BatchShape, signal: str, budget: float, task) -> BatchPlan:
    (w, p), R, cfg = planner.band_pair(signal), shape.num_requests, planner.config
    k = planner.pace(signal, p, shape.num_tokens)
    floor, saturation = (k * t for t in planner.band(shape, signal))
    if budget < floor or budget > saturation:
        return _reference_static(planner, shape, signal, budget, task, k, (floor, saturation))
    candidates = []
    for depth in planner.signal_depths(signal):
        best = None  # ((highest feasible grid index, -w), pair, paced TTFT on the grid)
        for pair in planner.signal_pairs(signal, depth):
            t = ttft_grid(planner.cost, shape, signal, (pair,), COVERAGE_GRID)[0] * planner.pace(
                signal, int(pair[1] > 0), shape.num_tokens)
            fits = np.nonzero(t <= budget)[0]
            key = (int(fits.max()) if fits.size else -1, -pair[0])
            best = max(best, (key, pair, t), key=lambda b: b[0]) if best else (key, pair, t)
        (i, _), pair, t = best
        if i < 0:
            continue
        cdf = planner.demand.cdf(signal, depth, task)
        uniform = [float(COVERAGE_GRID[i])] * R
        candidates.append((expected_passes(uniform, cdf), -depth, 1, pair, uniform, float(t[i])))
        alloc = allocate(shape.context_tokens, uniform[0] * sum(shape.context_tokens), cdf)
        candidates.append((expected_passes(alloc, cdf), -depth, 0, pair, alloc, None))
    for passes, _, _, pair, coverages, t in sorted(candidates, key=lambda c: c[:3], reverse=True):
        if t is None:
            t = float(ttft_rows(planner.cost, shape, signal, (pair,), np.array([coverages]))[0, 0]
                      * planner.pace(signal, int(pair[1] > 0), shape.num_tokens))
        if t <= budget:
            return BatchPlan(signal, *pair, tuple(coverages), t, passes, budget, floor, saturation, "planned",
                             task=task)
    cov = [cfg.r_min] * R  # nothing fits even at 0%
    t = float(planner.cost.ttft(shape, signal, w, p, np.array(cov))[0]) * k
    passes = float(read_at(planner.demand.cdf(signal, w + p, task), cov).sum())
    return BatchPlan(signal, w, p, tuple(cov), t, passes, budget, floor, saturation, "planned", task=task)


def _reference_static(planner: Planner, shape: BatchShape, signal: str, budget: float, task, k: float,
                      band: tuple[float, float]) -> BatchPlan:
    (w, p), R, cfg, (floor, saturation) = planner.band_pair(signal), shape.num_requests, planner.config, band
    r, ttft = cfg.r_min, floor
    if budget > saturation:
        t = ttft_grid(planner.cost, shape, signal, ((w, p),), COVERAGE_GRID)[0]
        fits = np.nonzero((t <= budget / k) & (COVERAGE_GRID >= cfg.r_max))[0]
        i = int(fits.max()) if fits.size else int(np.searchsorted(COVERAGE_GRID, cfg.r_max))
        r, ttft = float(COVERAGE_GRID[i]), float(t[i]) * k
    passes = float(read_at(planner.demand.cdf(signal, w + p, task), [r] * R).sum())
    return BatchPlan(signal, w, p, (r,) * R, ttft, passes, budget, floor, saturation,
                     "below_floor" if budget < floor else "above_saturation", task=task)


@pytest.mark.parametrize("config, gbps, tasks", [
    (PlannerConfig(), 5.0, (None, "a", "b")),
    (PlannerConfig(signal_rule="passes"), 5.0, (None,)),
    (PlannerConfig(signal_rule="entropy", num_splits=2, r_min=0.1, r_max=0.7), 5.0, (None,)),
    (PlannerConfig(signal="fused", signal_rule="passes"), 5.0, ("a",)),
    (PlannerConfig(pace_margin_z=1.0), 0.05, (None, "b")),
])
def test_decisions_equal_the_reference_search(config, gbps, tasks):
    planner, rng = Planner(profile_with_tasks(gbps), config), np.random.default_rng(2)
    for i in range(24):
        reqs = random_batch(rng, planner.theta, tasks[i % len(tasks)])
        floor, saturation = planner.band(planner.shape(reqs), planner.choose_signal(reqs))
        budget = float(rng.uniform(floor, saturation) if i % 4 else rng.uniform(0.5 * floor, 2 * saturation))
        plan = planner.plan(reqs, budget)
        assert asdict(replace(plan, decision_s=0.0)) == asdict(reference_plan(planner, reqs, budget))
        planner.observe(plan.signal, float(rng.uniform(0.7, 1.5)), plan.probe, planner.shape(reqs).num_tokens)
