"""The cost fit on hand-built samples (no model, no timing): per-pass costs with placed cached rows
and per-request work, and the per-batch overhead (per batch, token, request), recovered
from runs priced by known coefficients; the profile format that carries them; the costs-only
profile that keeps the packaged demand."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from cachesmith.planner import BatchShape, CostModel, Profile, ProfileError
from cachesmith.planner.cost_model import overhead_features, phase_seconds
from cachesmith.planner.profile import LAYER_KINDS, PROFILE_FORMAT, PhaseCost
from cachesmith.calibration import cost_run as run_mod
from cachesmith.calibration.cost_grid import default_grid
from cachesmith.calibration.costs import (ALL, HELD_OUT, PROFILE_PLANS, VALIDATION_PLANS, RunSpec, RunTiming, _samples,
                                       design_row, fit_costs, predicted_ttft, process_factors)
from cachesmith.calibration.packaged import PACKAGED_DIR
from cachesmith.calibration.quiet import QuietRun, cpu_busy, wait_for_quiet
from tests.planner.synthetic_profile import make_profile

L, KV_BYTES = 30, 1536
TRUE_COSTS = {  # (intercept, per row, per pair, per aux row, per request)
    "full": PhaseCost(1e-3, 3.5e-5, 9e-9, 0.0, 4e-4),
    "qci_probe": PhaseCost(2e-3, 3e-5, 9e-8, 0.0, 6e-4),
    "query_only": PhaseCost(1.5e-3, 5e-6, 1.3e-6, 0.0, 3e-4),
    "score_patch": PhaseCost(3e-3, 3e-5, 1.5e-8, 7e-6, 5e-4),
    "patch": PhaseCost(3e-3, 3.3e-5, 1.9e-8, 2e-7, 8e-4),
    "select": PhaseCost(2e-2, 1e-5, 0.0, 0.0, 3e-3),
}
TRUE_OVERHEAD = PhaseCost(6e-3, 3.5e-6, 0.0, 0.0, 1.2e-2)


def _profile(costs=TRUE_COSTS, overhead=TRUE_OVERHEAD, gbps=1e6) -> Profile:
    return Profile("fp", "m", "float32", "cpu", L, KV_BYTES, dict(costs), overhead, {"memory": gbps})


def _runs(truth: Profile, noise: float = 0.0, seed: int = 0, specs=None) -> list[RunTiming]:
    """Runs of `specs` (default: the profiling grid) priced by `truth`: every pass at its true cost
    and the TTFT at the cost model's walk (with `noise`: each pass and each TTFT times 1 +- noise,
    independently)."""
    rng = np.random.default_rng(seed)
    cost = CostModel(truth)
    runs = []
    for spec in specs or default_grid(16_384, num_shapes=24, plans_per_shape=6):
        rng_shape = np.random.default_rng(spec.seed)
        R = len(spec.contexts)
        shape = BatchShape(spec.contexts, tuple(int(x) for x in rng_shape.integers(16, 49, R)), (24,) * R)
        selected = tuple(int(c * spec.plan[3] * rng_shape.uniform(0.8, 1.0)) for c in spec.contexts)
        template = _samples(shape, spec.plan, L, [0.0] * _num_passes(spec.plan), selected)
        seconds = [float(phase_seconds(truth.layer_costs[s.kind], np.array([s.features]))[0])
                   * (1 + noise * rng.standard_normal()) for s in template]
        run = RunTiming(shape, spec.plan, 0.0, sum(seconds), _samples(shape, spec.plan, L, seconds, selected),
                        0.0, selected)
        total = predicted_ttft(cost, run)
        stall = total - predicted_ttft(CostModel(replace(truth, tier_gbps={"fast": 1e9})), run)  # link waits
        runs.append(replace(run, total_s=total * (1 + noise * rng.standard_normal()), stall_s=stall))
    return runs


def _num_passes(plan) -> int:
    from cachesmith.planner.cost_model import execution_steps
    from cachesmith.calibration.costs import plan_config

    cfg = plan_config(plan, L)
    return len(execution_steps(cfg.signal.value, cfg.warmup, cfg.probe, L))


def _close(got: PhaseCost, want: PhaseCost, rel: float, abs_: float = 1e-12) -> None:
    for g, w in zip(got.coefficients(), want.coefficients()):
        assert g == pytest.approx(w, rel=rel, abs=abs_), (got, want)


def test_fit_recovers_known_pass_and_overhead_coefficients():
    runs = _runs(_profile())
    costs, overhead = fit_costs(runs, L)
    for kind, want in TRUE_COSTS.items():
        _close(costs[kind], want, 1e-6)
    _close(overhead, TRUE_OVERHEAD, 1e-6)


def test_fit_recovers_the_costs_beside_the_link_waits_a_run_measured():
    """On a slow link a run waits for KV (its measured stall); the costs are what is left."""
    slow = _profile(gbps=0.3)
    runs = _runs(slow)
    assert sum(r.stall_s > 0.05 * r.total_s for r in runs) > 10
    costs, overhead = fit_costs(runs, L)
    for kind, want in TRUE_COSTS.items():
        _close(costs[kind], want, 1e-6)
    _close(overhead, TRUE_OVERHEAD, 1e-6)


def test_held_out_batch_shapes_are_priced_by_a_noisy_fit():
    """The validation the profiler runs, on timings priced by known costs with 10% noise per pass
    and per run: batch shapes and plans the grid never held are priced within a few percent of
    the truth. (How well the fit prices this machine's wall time is `benchmarks/cost_model.py`'s.)"""
    truth = _profile()
    costs, overhead = fit_costs(_runs(truth, noise=0.1, seed=3), L)
    fitted = CostModel(replace(truth, layer_costs=costs, overhead=overhead))
    held_out = [RunSpec(shape, plan, 1000 + i) for i, shape in enumerate(HELD_OUT) for plan in VALIDATION_PLANS]
    errors = [abs(predicted_ttft(fitted, run) / run.total_s - 1) for run in _runs(truth, specs=held_out)]
    assert len(errors) == len(HELD_OUT) * len(VALIDATION_PLANS)
    assert float(np.mean(errors)) < 0.03 and max(errors) < 0.08, errors
    # a fit in wrong units is off by far more
    wrong = CostModel(replace(truth, layer_costs={k: c.scaled(2.0) for k, c in costs.items()}, overhead=overhead))
    assert min(abs(predicted_ttft(wrong, run) / run.total_s - 1) for run in _runs(truth, specs=held_out)) > 0.3


def test_noisy_fit_keeps_the_per_request_and_placed_row_terms():
    """3% noise on every pass and TTFT: the terms that matter for cheap passes survive (a full pass's
    per-request term, or the overhead's, is lost in that noise, and matters as little), and TTFTs
    stay close."""
    costs, overhead = fit_costs(_runs(_profile(), noise=0.03, seed=1), L)
    assert costs["patch"].per_request_s == pytest.approx(8e-4, rel=0.15)
    assert costs["patch"].per_aux_s == pytest.approx(2e-7, rel=0.5)
    cost, truth = CostModel(_profile(costs, overhead)), CostModel(_profile())
    errors = np.array([predicted_ttft(cost, run) / predicted_ttft(truth, run) - 1 for run in _runs(_profile(), seed=2)])
    assert np.median(np.abs(errors)) < 0.02 and np.abs(errors).max() < 0.1


def test_processes_at_other_speeds_are_brought_to_one_before_the_fit():
    """Half the runs timed by a process 20% slower (the machine drifts between processes): the fit
    recovers the costs at the runs' geometric-mean speed, and the processes' factors."""
    runs = _runs(_profile())
    runs = [replace(r, process="a") if i % 2 else replace(r.scaled(1 / 1.2), process="b") for i, r in enumerate(runs)]
    costs, overhead = fit_costs(runs, L)
    level = math.sqrt(1.2)
    for kind, want in TRUE_COSTS.items():
        _close(costs[kind], want.scaled(level), 1e-2, 1e-8)
    _close(overhead, TRUE_OVERHEAD.scaled(level), 1e-2, 1e-8)
    factors = process_factors(runs, CostModel(_profile(costs, overhead)))
    assert factors["b"] / factors["a"] == pytest.approx(1.2, rel=1e-3)


def test_per_request_and_overhead_features_are_priced():
    profile = _profile()
    cost = CostModel(profile)
    one, four = BatchShape((4000,), (32,), (24,)), BatchShape((1000,) * 4, (8,) * 4, (6,) * 4)  # same tokens
    assert overhead_features(four).tolist() == [[1.0, 4056.0, 0.0, 0.0, 4.0]]
    assert cost.overhead_seconds(four) - cost.overhead_seconds(one) == pytest.approx(3 * 1.2e-2)
    # a full-prefill pass of four requests pays three more per-request terms (and fewer attention pairs)
    gap = cost.full_prefill_ttft(four) - cost.full_prefill_ttft(one)
    pairs = 4 * 1014 ** 2 - 4056 ** 2
    assert gap == pytest.approx(3 * 1.2e-2 + L * (3 * 4e-4 + 9e-9 * pairs), rel=1e-9)


def test_run_record_round_trip():
    run = _runs(_profile())[5]
    again = RunTiming.from_record(json.loads(json.dumps(run.to_record("k"))), L)
    assert again.shape == run.shape and again.plan == run.plan and again.total_s == run.total_s
    assert [(s.kind, s.seconds) for s in again.samples] == [(s.kind, s.seconds) for s in run.samples]
    np.testing.assert_allclose([s.features for s in again.samples], [s.features for s in run.samples])


def test_design_row_prices_a_run_as_the_cost_model_walks_it():
    # benchmarks/cost_floor.py fits the cost model's form to served batches through design_row:
    # with a link that never waits, the row times the coefficients is the model's TTFT
    truth = _profile()
    coef = np.concatenate([truth.layer_costs[k].coefficients() for k in LAYER_KINDS] + [truth.overhead.coefficients()])
    runs = _runs(truth)
    assert {r.plan[0] for r in runs} == {"position", "kv_dev", "qci", "qci_last"}
    for run in runs:
        assert design_row(run, L) @ coef == pytest.approx(predicted_ttft(CostModel(truth), run), rel=1e-6)


def test_default_grid_covers_batch_sizes_and_plans_within_the_token_cap():
    grid = default_grid(16_384)
    assert {len(s.contexts) for s in grid} == {1, 2, 3, 4, 6, 8}
    assert {s.plan for s in grid} == set(PROFILE_PLANS)
    assert max(sum(s.contexts) + len(s.contexts) * 72 for s in grid) <= 16_384
    assert all(sum(s.contexts) <= 8192 for s in grid if s.plan[1] >= ALL)  # full prefill: the smaller half
    assert len({s.key for s in grid}) == len(grid)
    assert RunSpec((5, 6), ("qci", 1, 1, 0.3), 7).key == "5,6|qci,1,1,0.3|7"


def test_format_1_profiles_are_refused_by_name(tmp_path):
    data = json.loads((PACKAGED_DIR / "smollm2-135m-float32-cpu.json").read_text())
    data["format_version"] = 1
    for c in [*data["layer_costs"].values(), data["overhead"]]:
        c.pop("per_request_s", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"format_version 1, this cachesmith reads {PROFILE_FORMAT}"):
        Profile.load(path)
    curves, theta = run_mod.read_demand(path)  # demand is still readable from an old file
    assert curves and 0 < theta < 1


def test_costs_only_profile_keeps_the_demand_it_is_given(tmp_path, monkeypatch):
    source = make_profile()
    source.save(tmp_path / "demand.json")
    measured = replace(_profile(), demand=(), entropy_threshold=0.5)
    monkeypatch.setattr(run_mod, "base_profile", lambda pipe, config, out, show: (measured, {
        "ttft_rel_err_mean": 0.04, "ttft_rel_err_max": 0.1, "rows": []}))
    out = tmp_path / "p.json"
    config = run_mod.ProfileConfig(num_requests=1)
    pipe = type("P", (), {"model": None})()
    profile = run_mod.run_costs_profile(pipe, config, out, demand_from=tmp_path / "demand.json", show_progress=False)
    assert profile.demand == source.demand and profile.entropy_threshold == source.entropy_threshold
    assert profile.layer_costs == measured.layer_costs and profile.fit_error == {"ttft_rel_err_mean": 0.04,
                                                                                   "ttft_rel_err_max": 0.1}
    assert Profile.load(out) == profile
    with pytest.raises(ProfileError, match="no profile at"):
        run_mod.run_costs_profile(pipe, config, out, demand_from=tmp_path / "missing.json")


class FakeMachine:
    """/proc/stat's counters on a fake clock: `load(t)` of all cores busy at time t, of which this
    process uses `own` cores; sleeping advances the clock. The gate's logic, not the load of the
    machine running the test, decides what the assertions see."""

    def __init__(self, load, own: float = 0.0, num_cpus: int = 2) -> None:
        self.load, self.own, self.num_cpus, self.now = load, own, num_cpus, 0.0
        self.busy_s = self.own_s = 0.0

    def advance(self, dt: float) -> None:
        steps = max(1, int(dt / 0.01))
        for _ in range(steps):
            self.busy_s += self.load(self.now) * self.num_cpus * dt / steps
            self.own_s += self.own * dt / steps
            self.now += dt / steps

    def install(self, monkeypatch) -> "FakeMachine":
        from cachesmith.calibration import quiet

        monkeypatch.setattr(quiet, "NUM_CPUS", self.num_cpus)
        monkeypatch.setattr(quiet, "_machine", lambda: (self.busy_s, self.now * self.num_cpus))
        monkeypatch.setattr(quiet, "_own_cpu_s", lambda: self.own_s)
        monkeypatch.setattr(quiet.time, "sleep", self.advance)
        monkeypatch.setattr(quiet.time, "monotonic", lambda: self.now)
        return self


def test_cpu_busy_reads_a_share_of_all_cores():
    busy = cpu_busy(0.05)  # the real /proc/stat: a share, whatever the load
    assert busy is None or 0.0 <= busy <= 1.0


def test_quiet_gate_waits_for_the_load_to_drop_and_gives_up_at_its_limit(monkeypatch):
    machine = FakeMachine(lambda t: 0.5 if t < 6.0 else 0.05).install(monkeypatch)
    assert cpu_busy(0.5) == pytest.approx(0.5)
    assert wait_for_quiet(max_busy=0.6, window_s=0.5).waited_s == pytest.approx(1.0)  # two windows
    late = wait_for_quiet(max_busy=0.2, window_s=0.5, max_wait_s=2.0)
    assert not late.is_quiet and late.busy == pytest.approx(0.5) and 2.0 <= late.waited_s < 3.0
    calm = wait_for_quiet(max_busy=0.2, window_s=0.5)  # quiet from t = 6 on
    assert calm.is_quiet and machine.now >= 6.0 + 1.0 and calm.busy == pytest.approx(0.05)


def test_quiet_run_measures_the_other_processes_share(monkeypatch):
    machine = FakeMachine(lambda t: 0.8, own=1.0).install(monkeypatch)  # own 1 core of 1.6 busy
    with QuietRun(max_busy=1.0, max_other=0.5) as run:
        machine.advance(2.0)
    assert run.other == pytest.approx(0.3) and run.is_quiet
    with QuietRun(max_busy=1.0, max_other=0.2) as strict:
        machine.advance(2.0)
    assert not strict.is_quiet and strict.record() == {"waited_s": strict.wait.waited_s, "other": strict.other,
                                                       "is_quiet": False}

