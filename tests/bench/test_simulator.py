"""The simulator: the real Engine loop, scheduler and planner on cost-model time with table verdicts."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from cachesmith.bench.setting import BenchConfig
from cachesmith.clock import ReplayClock
from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import ConfigError, InputError
from cachesmith.planner import BatchShape, CostModel
from cachesmith.recompute import parse_label, preset
from cachesmith.scheduler import SchedulerConfig
from cachesmith.scheduler.types import batch_shape
from cachesmith.bench.sim_executor import SimExecutor
from cachesmith.bench.grid import GridConfig, Run, run_grid, runs
from cachesmith.bench.simulate import FixedDecisionTime, base_slo, instance_for, simulate, simulate_run
from tests.planner.synthetic_profile import make_profile
from tests.bench.sim_helpers import NUM_LAYERS, outcome, table


def sim_engine(method: str, profile, t, gbps: float | None = None, decision_s: float | None = None) -> Engine:
    """`decision_s`: every decision costs this much virtual time (None: its measured wall time)."""
    link = CostModel(profile, gbps)
    engine = Engine(None, profile, EngineConfig(method), ReplayClock(),
                    runtime=lambda p: SimExecutor(t, p, link, decision_s=decision_s))
    if decision_s is not None:
        engine.scheduler = FixedDecisionTime(engine.scheduler, decision_s)
    return engine


def test_full_prefill_alone_takes_the_cost_models_ttft_and_the_tables_verdict():
    profile, t = make_profile(), table()
    engine = sim_engine("full_prefill", profile, t, decision_s=0.0)
    reqs = [engine.executor.request(i, o, 50.0, 100.0 * i) for i, o in enumerate(t.outcomes[:6])]  # far apart: alone
    results = engine.run(reqs)
    cost = CostModel(profile)
    for r, o in zip(results, t.outcomes):
        expected = cost.full_prefill_ttft(BatchShape((o.context_tokens,), (o.suffix_tokens,), (o.prefix_tokens,)))
        assert r.ttft_s == pytest.approx(expected, rel=1e-9)
        assert r.is_passed == o.plans["(position,30,0,100%)"] and r.batch_size == 1 and r.answer == ""
    assert engine.stats.stall_s == pytest.approx(0.0, abs=1e-9)  # the profile's link outpaces compute


def test_cachesmith_plans_from_table_entropies_and_gets_each_plans_verdict():
    profile, t = make_profile(), table()
    engine = sim_engine("cachesmith", profile, t, decision_s=0.002)
    reqs = [engine.executor.request(i, o, 3.0, 0.05 * i) for i, o in enumerate(t.outcomes)]  # a burst: real batches
    results = engine.run(reqs)
    assert max(r.batch_size for r in results) > 1 and {r.mode for r in results} >= {"planned"}
    for r, o in zip(results, t.outcomes):
        s, w, p, _ = parse_label(r.plan)
        assert r.is_passed == t.passes(o, s, w, p, r.coverage)
        assert r.qci_entropy == o.entropy and r.num_recomputed == round(r.coverage * o.context_tokens)


def test_a_slow_link_stalls_full_reuse_and_the_stall_is_reported():
    profile, t = make_profile(), table(4)
    engine = sim_engine("full_reuse", profile, t, gbps=0.01)
    engine.run([engine.executor.request(0, t.outcomes[0], 50.0, 0.0)])
    assert engine.stats.stall_s > 0.5 * engine.stats.busy_s


def test_a_simulated_request_is_refused_by_name_where_it_is_made():
    profile, t = make_profile(), table(4)
    engine = sim_engine("cachesmith", profile, t)
    with pytest.raises(InputError, match="request 0: the prompt's .* exceed the model's 8192 positions"):
        engine.executor.request(0, outcome(99, context=9000), 5.0)
    with pytest.raises(InputError, match="request 1: slo_s=0.0"):
        engine.executor.request(1, t.outcomes[1], 0.0)
    engine.config = replace(engine.config, scheduler=SchedulerConfig(kv_capacity_tokens=2000))
    big = engine.executor.request(2, outcome(98, context=3000), 5.0)  # past the engine's own limit: refused
    results = engine.run([big, engine.executor.request(3, t.outcomes[1], 5.0)])
    assert "KV capacity of 2000 tokens" in results[0].error and results[1].error is None


def test_instances_are_the_measured_ones_by_seed_else_drawn_from_the_task():
    t = table()
    assert instance_for(t, "mix", 5) is t.outcomes[5]
    assert instance_for(t, "vt", 6).task == "vt" and instance_for(t, "vt", 6) is t.outcomes[6]
    drawn = instance_for(t, "vt", 1001)
    assert drawn.task == "vt" and drawn is instance_for(t, "vt", 1001)


def test_simulate_summarizes_every_method_with_best_static():
    profile, t = make_profile(), table()
    config = BenchConfig("mix", num_requests=30, utilization=0.8, slo_scales=(1.0, 3.0),
                         methods=("cachesmith", "full_prefill", "cacheblend@0.3"))
    res = simulate(t, profile, config)
    assert res.base_slo_s == pytest.approx(base_slo(t, profile))
    assert len(res.rows) == 2 * 3 + 2 and len(res.records) == 2 * 3 * 30
    rows = {(r["method"], r["slo_scale"]): r for r in res.rows}
    assert rows[("full_prefill", 3.0)]["ttft_attainment"] >= rows[("full_prefill", 1.0)]["ttft_attainment"]
    best = rows[("best_static", 1.0)]
    assert best["qsa"] == max(rows[(m, 1.0)]["qsa"] for m in ("full_prefill", "cacheblend@0.3"))


def test_the_grid_enumerates_the_papers_settings_and_resumes(tmp_path):
    counted = list(runs(GridConfig(studies=("grid",))))
    assert len(counted) == 5 * 6 * 4 * 16 and len({r.key for r in counted}) == len(counted)  # 11 + 5 variants
    profile, t = make_profile(), table()
    t.save(tmp_path / "t.json")
    profile.save(tmp_path / "p.json")
    cfg = GridConfig(num_requests=12, studies=("band",))
    out = tmp_path / "rows.jsonl"
    rows = run_grid(tmp_path / "t.json", tmp_path / "p.json", 1.0, out, cfg, num_workers=1, show_progress=False)
    assert len(rows) == 9 and {(r["r_min"], r["r_max"]) for r in rows} == {
        (a, b) for a in (0.02, 0.05, 0.1) for b in (0.3, 0.5, 0.75)}
    lines = out.read_text().splitlines()
    again = run_grid(tmp_path / "t.json", tmp_path / "p.json", 1.0, out, cfg, num_workers=1, show_progress=False)
    assert out.read_text().splitlines() == lines and [r["qsa"] for r in again] == [r["qsa"] for r in rows]
    one = Run("band", "pr", "gamma", 3.0, 0.7, 2.0, "cachesmith", r_min=0.02, r_max=0.3)
    assert json.loads(lines[0])["key"] == one.key
    records, _ = simulate_run(t, profile, BenchConfig("pr", num_requests=12, pattern="gamma", cv=3.0),
                              rows[0]["base_slo_s"], "cachesmith", 2.0)
    assert all(r["task"] == "pr" for r in records)


def test_a_pool_is_cycled_by_request_id_like_the_replay_benchs_workload_files():
    profile, t = make_profile(), table(6)
    config = BenchConfig("file", workload_file="w.jsonl", num_requests=14)
    records, _ = simulate_run(t, profile, config, 2.0, "full_prefill", 2.0, pool=t.outcomes[:4])
    assert [r["task"] for r in records] == [t.outcomes[i % 4].task for i in range(14)]
    assert [r["num_context_tokens"] for r in records] == [t.outcomes[i % 4].context_tokens for i in range(14)]


def test_paces_slow_a_plan_family_and_the_planner_learns_it():
    from cachesmith.bench.pace import family

    profile, t = make_profile(), table(8)
    cost = CostModel(profile)
    o = t.outcomes[1]
    shape = BatchShape((o.context_tokens,), (o.suffix_tokens,), (o.prefix_tokens,))
    link = CostModel(profile)
    engine = Engine(None, profile, EngineConfig("full_prefill"), ReplayClock(),
                    runtime=lambda p: SimExecutor(t, p, link, {family("position", 30, 0): 2.0}))
    (r,) = engine.run([engine.executor.request(0, o, 50.0)])
    assert r.ttft_s == pytest.approx(2 * cost.full_prefill_ttft(shape), rel=0.02)  # the overhead is paced too
    paced = Engine(None, profile, EngineConfig("cachesmith"), ReplayClock(),
                   runtime=lambda p: SimExecutor(t, p, link, {"kv_dev/1/1": 1.5, "qci/1/1": 1.5}))
    paced.run([paced.executor.request(i, x, 8.0, 10.0 * i) for i, x in enumerate(t.outcomes)])
    assert paced.planner.correction and all(k == pytest.approx(1.5, rel=0.05)
                                            for k in paced.planner.correction.values())


def test_a_large_batch_pace_applies_to_batches_of_that_many_tokens_only():
    profile, t = make_profile(), table(8)
    ex = SimExecutor(t, None, CostModel(profile), {"kv_dev/1/1": 1.0, "kv_dev/1/1@4k+": 2.0})
    single, _ = ex.machine("kv_dev", 1, 1, 4095)
    double, _ = ex.machine("kv_dev", 3, 2, 4096)
    shape = BatchShape((900,), (30,), (10,))
    # compute doubles; the link (not paced) hides a little less of itself
    assert double.ttft(shape, "kv_dev", 1, 1, [0.3])[0] == pytest.approx(2 * single.ttft(shape, "kv_dev", 1, 1, [0.3])[0],
                                                                       rel=1e-3)
    assert ex.machine("qci", 1, 1, 9000)[0].ttft(shape, "qci", 1, 1, [0.3])[0] == pytest.approx(
        CostModel(profile).ttft(shape, "qci", 1, 1, [0.3])[0])  # no pace: the profile's speed


def _planned_run(ex: SimExecutor, t, ids=(1, 2), budget: float = 2.0):
    from cachesmith.scheduler import ScheduleDecision

    batch = [ex.request(i, t.outcomes[i], 10.0) for i in ids]
    return batch, ex.prefill(ScheduleDecision(tuple(ids), budget, "planned"), batch)


def test_on_the_machine_the_planner_believes_the_monitor_never_acts():
    from cachesmith.planner import Planner

    profile, t = make_profile(), table(8)
    ex = SimExecutor(t, Planner(profile), CostModel(profile))
    batch, run = _planned_run(ex, t, budget=50.0)
    assert run.num_monitor_replans == 0 and run.final_coverages == run.coverages
    assert run.seconds == pytest.approx(run.plan.predicted_ttft_s + run.plan.decision_s, rel=1e-9)
    outs = ex.decode(batch, run)
    assert [o.num_recomputed for o in outs] == [round(c * ex.admit(r).context_tokens)
                                               for c, r in zip(run.coverages, batch)]


def test_a_machine_slower_than_the_plan_makes_the_monitor_lower_coverage_and_verdicts_follow():
    from cachesmith.bench.pace import MachinePace
    from cachesmith.planner import Planner

    profile, t = make_profile(), table(8)
    slow = MachinePace({"kv_dev/1/1": 2.0, "qci/1/1": 2.0})
    planner = Planner(profile)
    ex = SimExecutor(t, planner, CostModel(profile), slow)
    batch, run = _planned_run(ex, t)
    unmonitored = SimExecutor(t, Planner(profile), CostModel(profile), slow)
    signal, w, p = run.plan.signal, run.plan.warmup, run.plan.probe
    as_planned, _ = unmonitored._ttft(batch_shape([ex.admit(r) for r in batch]), run.plan.recompute_config(),
                                      np.array([run.coverages]))
    assert run.num_monitor_replans > 0
    assert all(f < c for f, c in zip(run.final_coverages, run.coverages))
    assert run.seconds < as_planned  # lowered coverage: the batch ends sooner than its plan would
    assert run.verdicts == [t.passes(ex.outcomes[r.request_id], signal, w, p, f) for r, f in zip(batch, run.final_coverages)]
    assert planner.correction[signal] == pytest.approx(2.0, rel=0.1)  # the pace the monitor saw


def test_the_machine_prices_placed_cached_rows_per_patch_pass():
    from cachesmith.bench.pace import MachinePace
    from cachesmith.planner.cost_model import execution_steps

    profile, t = make_profile(), table(4)
    shape = BatchShape((900, 400), (30, 20), (10, 0))
    plain = SimExecutor(t, None, CostModel(profile, 1e9), MachinePace({"qci/1/1": 1.5}))
    priced = SimExecutor(t, None, CostModel(profile, 1e9), MachinePace({"qci/1/1": 1.5}, reuse_per_row=0.2))
    num_patch = sum(s.kind == "patch" and s.places for s in execution_steps("qci", 1, 1, 30))
    extra = (priced.machine("qci", 1, 1, 1360)[0].ttft(shape, "qci", 1, 1, [[0.3, 0.3]])[0]
             - plain.machine("qci", 1, 1, 1360)[0].ttft(shape, "qci", 1, 1, [[0.3, 0.3]])[0])
    row_s = 0.2 * profile.layer_costs["patch"].per_row_s  # a fifth of recomputing the row
    assert extra == pytest.approx(row_s * num_patch * (900 + 10 + 400), rel=1e-9)


def test_the_machine_can_run_on_another_profile_than_the_planner_plans_with():
    from cachesmith.calibration.packaged import rescaled

    profile, t = make_profile(), table(4)
    o = t.outcomes[1]
    records, _ = simulate_run(t, profile, BenchConfig("file", workload_file="w.jsonl", num_requests=1), 2.0,
                              "full_prefill", 50.0, pool=[o], machine_profile=rescaled(profile, 2.0))
    shape = BatchShape((o.context_tokens,), (o.suffix_tokens,), (o.prefix_tokens,))
    assert records[0]["ttft_s"] == pytest.approx(2 * CostModel(profile).full_prefill_ttft(shape), rel=0.02)


def test_the_learning_method_hears_the_verdict_of_every_planned_request():
    from dataclasses import replace

    from tests.planner.test_served_mix import two_task_demand

    profile, t = replace(make_profile(), demand=two_task_demand()), table()
    engine = sim_engine("cachesmith+learn", profile, t)
    heard = []
    engine.planner.served_mix.observe = lambda *verdict: heard.append(verdict)
    results = engine.run([engine.executor.request(i, o, 3.0, 0.05 * i) for i, o in enumerate(t.outcomes)])
    planned = [r for r in results if r.mode == "planned"]
    assert planned and len(heard) == len(planned)

    def verdict(r):
        s, w, p, _ = parse_label(r.plan)
        return s, w + p, round(r.num_recomputed / r.num_context_tokens, 6), r.is_passed
    assert sorted(verdict(r) for r in planned) == sorted((s, d, round(c, 6), ok) for s, d, c, ok in heard)
    assert sim_engine("cachesmith", profile, t).planner.served_mix is None  # the default does not learn


def test_machine_noise_wanders_with_the_std_and_correlation_asked_and_repeats_by_seed():
    from itertools import islice

    from cachesmith.bench.sim_executor import MachineNoise

    assert set(islice(MachineNoise().factors(), 50)) == {1.0}  # no noise: the machine holds steady
    x = np.log(list(islice(MachineNoise(0.3, 0.7, seed=5).factors(), 20000)))
    assert np.std(x) == pytest.approx(0.3, rel=0.08) and abs(np.median(x)) < 0.03
    assert np.corrcoef(x[:-1], x[1:])[0, 1] == pytest.approx(0.7, abs=0.05)
    assert list(islice(MachineNoise(0.3, 0.7, seed=5).factors(), 5)) == list(np.exp(x[:5]))
    with pytest.raises(ConfigError, match="sigma"):
        MachineNoise(-0.1)
    with pytest.raises(ConfigError, match="corr"):
        MachineNoise(0.2, 1.0)
    with pytest.raises(ConfigError, match="sigma"):
        GridConfig(noise_sigma=2.0)


def test_a_noisy_machine_slows_each_batch_by_its_draw_and_the_planner_hears_the_spread():
    from itertools import islice

    from cachesmith.bench.sim_executor import MachineNoise

    profile, t = make_profile(), table(8)
    noise = MachineNoise(0.3, 0.5, seed=2)
    link, cost = CostModel(profile), CostModel(profile)
    engine = Engine(None, profile, EngineConfig("full_prefill"), ReplayClock(),
                    runtime=lambda p: SimExecutor(t, p, link, None, noise, decision_s=0.0))
    engine.scheduler = FixedDecisionTime(engine.scheduler, 0.0)
    results = engine.run([engine.executor.request(i, o, 50.0, 100.0 * i) for i, o in enumerate(t.outcomes[:5])])  # alone
    for r, o, factor in zip(results, t.outcomes, islice(noise.factors(), 5)):
        shape = BatchShape((o.context_tokens,), (o.suffix_tokens,), (o.prefix_tokens,))
        assert r.ttft_s == pytest.approx(factor * cost.full_prefill_ttft(shape), rel=1e-9)
    spreads = {}
    for sigma in (0.0, 0.3):
        planned = Engine(None, profile, EngineConfig("cachesmith"), ReplayClock(),
                         runtime=lambda p: SimExecutor(t, p, link, None, MachineNoise(sigma, 0.5, seed=3)))
        planned.run([planned.executor.request(i, t.outcomes[i % 8], 8.0, 10.0 * i) for i in range(40)])
        spreads[sigma] = planned.planner.paces.spread()
    assert spreads[0.0] < 0.02 and spreads[0.3] > 0.1


def test_fixed_decision_times_make_a_simulated_run_repeat_exactly_and_cost_what_was_asked():
    profile, t = make_profile(), table()
    config = BenchConfig("mix", num_requests=40, pattern="gamma", cv=3.0, utilization=0.9)
    base = base_slo(t, profile)
    first, stats = simulate_run(t, profile, config, base, "cachesmith", 2.0, decision_s=0.002)
    again, _ = simulate_run(t, profile, config, base, "cachesmith", 2.0, decision_s=0.002)
    assert first == again and max(r["batch_size"] for r in first) > 1  # batched, planned, repeated
    planned = {r["batch_id"] for r in first if r["mode"] == "planned"}
    expected = [4.0 if b in planned else 2.0 for b in range(stats.num_batches)]  # scheduler 2 ms (+ planner 2 ms)
    assert planned and stats.decision_ms == pytest.approx(expected)
    lone = BenchConfig("pr", num_requests=1)
    slow = simulate_run(t, profile, lone, 50.0, "cachesmith", 2.0, decision_s=0.05)[0][0]
    fast = simulate_run(t, profile, lone, 50.0, "cachesmith", 2.0, decision_s=0.0)[0][0]
    assert slow["ttft_s"] - fast["ttft_s"] == pytest.approx(0.1, abs=1e-9)  # scheduling + planning
    with pytest.raises(ConfigError, match="decision_s"):
        simulate_run(t, profile, lone, 50.0, "cachesmith", 2.0, decision_s=-1.0)
    with pytest.raises(ConfigError, match="decision_ms"):
        GridConfig(decision_ms=5000.0)


def test_a_preset_the_table_never_measured_is_refused_not_judged_as_full_reuse(tmp_path):
    profile, t = make_profile(), table(8)
    epic_plans = {preset("epic", c, NUM_LAYERS).label() for c in (0.15, 0.3)}
    for o in t.outcomes[2:]:  # flips-only instances, as the demand table holds: no EPIC
        o.plans = {k: v for k, v in o.plans.items() if k not in epic_plans}
        o.__dict__.pop("static", None)
    config = BenchConfig("mix", num_requests=6)
    with pytest.raises(InputError, match=r"epic@0.15.*6 of 8 instances"):
        simulate_run(t, profile, config, 2.0, "epic@0.15", 2.0)
    with pytest.raises(InputError, match="epic@0.3"):
        simulate(t, profile, BenchConfig("mix", num_requests=6, methods=("full_reuse", "epic@0.3")), 2.0)
    # what every instance measured still runs, and a pool of measured instances serves EPIC
    for method in ("cacheblend@0.15", "full_reuse", "full_prefill", "cachesmith"):
        assert len(simulate_run(t, profile, config, 2.0, method, 2.0)[0]) == 6
    assert len(simulate_run(t, profile, config, 2.0, "epic@0.15", 2.0, pool=t.outcomes[:2])[0]) == 6
    # the grid refuses before any run, so no row of a half-judged grid is cached
    t.save(tmp_path / "t.json")
    profile.save(tmp_path / "p.json")
    out = tmp_path / "rows.jsonl"
    cfg = GridConfig(num_requests=6, studies=("grid",), tasks=("pr",), methods=("full_reuse", "epic@0.3"))
    with pytest.raises(InputError, match="epic@0.3"):
        run_grid(tmp_path / "t.json", tmp_path / "p.json", 1.0, out, cfg, num_workers=1, show_progress=False)
    assert not out.exists() or out.read_text() == ""


def test_the_simulators_machine_is_the_validation_overlaid_by_the_refit_where_each_exists(tmp_path):
    from cachesmith.bench.grid import simulator_machine

    validation, machine = tmp_path / "v.json", tmp_path / "m.json"
    assert simulator_machine(validation, machine) == (1.0, None) and simulator_machine(None, None) == (1.0, None)
    validation.write_text(json.dumps({"speed_factor": 1.9, "paces": {"kv_dev": 1.2}}))
    assert simulator_machine(validation, machine) == (1.9, {"kv_dev": 1.2})
    machine.write_text(json.dumps({"speed_factor": 2.1, "machine": {"reuse": 0.3}}))
    assert simulator_machine(validation, machine) == (2.1, {"reuse": 0.3})
