"""Pace per plan family, measured on a tiny random model against a profile of its layer count."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cachesmith.bench.pace import calibration_plans, family, measure_paces
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile


def test_every_plan_family_gets_a_positive_pace_and_the_result_is_cached(tmp_path):
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path / "m"), tmp_path / "kv")
    profile = make_profile(num_layers=pipe.model.num_layers)
    out = tmp_path / "paces.json"
    paces = measure_paces(pipe, profile, [instance(0), instance(1, num_docs=2)], out, num_repeats=1,
                          show_progress=False)
    plans = calibration_plans(pipe.model.num_layers)
    assert set(paces) == {family(p.signal.value, p.warmup, p.probe) for p in plans}
    assert {"position/1/0", "position/0/0", "kv_dev/1/0", "kv_dev/1/1", "qci/1/1", "qci/0/1", "qci_last/0/1",
            "qci_last/1/1", "fused/1/1"} == set(paces)
    assert all(v > 0 for v in paces.values())
    saved = json.loads(out.read_text())
    assert all(len(v) == 2 * sum(family(p.signal.value, p.warmup, p.probe) == k for p in plans)
               for k, v in saved["ratios"].items())
    assert measure_paces(None, profile, [], out) == paces  # cached: nothing measured again


def test_the_fit_recovers_paces_and_reuse_and_batch_costs_and_scales_untraced_families():
    from cachesmith.bench.pace import MachinePace, TraceBatch, fit_machine

    truth = MachinePace({"kv_dev/1/1": 0.8, "kv_dev/1/1@4k+": 1.3, "qci/1/1": 1.2}, reuse_per_row=0.2, per_batch=5.0)
    rng = np.random.default_rng(0)
    batches = []
    for i in range(40):
        fam, num, tokens = [("kv_dev/1/1", 1, 2000), ("kv_dev/1/1", 3, 6000), ("qci/1/1", 1, 1500)][i % 3]
        b = TraceBatch("m", fam, num, tokens, float(rng.uniform(0.5, 3.0)), float(rng.uniform(0.1, 2.0)), 0.0,
                       float(rng.uniform(0.005, 0.01)))
        batches.append(TraceBatch(b.method, fam, num, tokens, b.predicted_s, b.reuse_s, b.machine_s(truth), b.batch_s))
    big = TraceBatch("m", "qci/1/1", 2, 5000, 1.0, 0.5, 0.0, 0.01)
    batches += [TraceBatch(**{**big.__dict__, "measured_s": big.machine_s(truth)})] * 2  # too few for @4k+
    fit = fit_machine(batches, isolated={"kv_dev/1/1": 0.4, "position/1/0": 0.5})
    assert fit.reuse_per_row == pytest.approx(0.2, rel=1e-2) and fit.per_batch == pytest.approx(5.0, rel=1e-2)
    assert fit.paces["kv_dev/1/1"] == pytest.approx(0.8, rel=1e-2)
    assert fit.paces["kv_dev/1/1@4k+"] == pytest.approx(1.3, rel=1e-2)
    assert fit.pace("kv_dev/1/1", 9000) == fit.paces["kv_dev/1/1@4k+"]  # no @8k+ class: the next coarser
    assert "qci/1/1@4k+" not in fit.paces and fit.pace("qci/1/1", 5000) == fit.paces["qci/1/1"]
    assert fit.paces["qci/1/1"] == pytest.approx(1.2, rel=1e-2)
    assert fit.paces["position/1/0"] == pytest.approx(0.5 * 0.8 / 0.4, rel=1e-2)  # at the trace's level


def test_the_paces_only_fit_leaves_placed_rows_and_batch_overhead_to_the_profile():
    from cachesmith.bench.pace import TraceBatch, fit_machine, fit_paces

    # measured = 1.5x the profile's compute for kv_dev/1/1 and 0.9x for full prefill, plus 0.1 s a
    # batch that a full fit would book as 2x the batch overhead (0.05 s): the paces-only fit must not
    batches = [TraceBatch("m", fam, 1, 1000, pred, 0.0, pace * pred + 0.1, 0.05)
               for fam, pace in (("kv_dev/1/1", 1.5), ("position/1/0", 0.9)) for pred in (0.5, 1.0, 2.0, 3.0)]
    assert fit_machine(batches).per_batch == pytest.approx(2.0, rel=1e-2)
    machine, rows = fit_paces(batches, num_layers=4)
    assert machine.reuse_per_row == 0.0 and machine.per_batch == 0.0
    kv, full = machine.paces["kv_dev/1/1"], machine.paces["position/1/0"]
    assert 1.5 < kv < 1.65 and 0.9 < full < 1.05  # the 0.1 s lands in the paces
    plans = calibration_plans(4)
    untraced = {family(p.signal.value, p.warmup, p.probe) for p in plans} - {"kv_dev/1/1", "position/1/0"}
    assert untraced and all(machine.paces[f] == pytest.approx((kv + full) / 2) for f in untraced)  # median level
    by_key = {r["key"]: r for r in rows}
    assert by_key["kv_dev/1/1@1"]["before"] > 1.5 and abs(by_key["kv_dev/1/1@1"]["after"] - 1) < 0.05
    assert by_key["position/1/0@1"]["batches"] == 4 and abs(by_key["position/1/0@1"]["after"] - 1) < 0.05


def test_trace_batches_time_each_batch_from_its_start_at_the_coverage_it_ended_with():
    from cachesmith.bench.pace import trace_batches
    from cachesmith.planner import BatchShape, CostModel
    from cachesmith.planner.cost_model import execution_steps
    from tests.bench.sim_helpers import table

    profile, t = make_profile(), table(4)

    def rec(rid, batch, arrival, first, recomputed, plan="(qci,1,1,40%)"):
        return {"request_id": rid, "method": "cachesmith", "batch_id": batch, "arrival_s": arrival, "error": None,
                "first_token_s": first, "plan": plan, "coverage": 0.4, "num_recomputed": recomputed,
                "num_context_tokens": t.outcomes[rid].context_tokens}

    o0, o1, o2 = t.outcomes[:3]
    records = [rec(0, 0, 1.0, 3.0, int(0.4 * o0.context_tokens)),
               rec(1, 1, 2.0, 5.5, int(0.2 * o1.context_tokens)), rec(2, 1, 2.5, 5.5, 0),  # waited: from 3.0
               {**rec(3, 2, 9.0, 9.5, 0, "(position,0,0,0%)")}]  # idle until its arrival at 9.0
    a, b, c = trace_batches(records, t.outcomes, profile)
    assert (a.measured_s, b.measured_s, c.measured_s) == (2.0, 2.5, 0.5)
    assert (a.family, b.family, b.num_requests, c.family) == ("qci/1/1", "qci/1/1", 2, "position/0/0")
    assert b.num_tokens == sum(o.context_tokens + o.suffix_tokens + o.prefix_tokens for o in (o1, o2))
    assert b.batch_s == profile.overhead.intercept_s
    shape = BatchShape((o1.context_tokens, o2.context_tokens), (o1.suffix_tokens, o2.suffix_tokens),
                       (o1.prefix_tokens, o2.prefix_tokens))
    cov = [[int(0.2 * o1.context_tokens) / o1.context_tokens, 0.0]]
    assert b.predicted_s == pytest.approx(CostModel(profile).ttft(shape, "qci", 1, 1, cov)[0])
    num_patch = sum(s.kind == "patch" and s.places for s in execution_steps("qci", 1, 1, profile.num_layers))
    placed = num_patch * sum(o.context_tokens + o.prefix_tokens for o in (o1, o2))
    assert b.reuse_s == pytest.approx(placed * profile.layer_costs["patch"].per_row_s)


def test_a_machine_pace_prices_patch_rows_and_round_trips_through_json():
    from cachesmith.bench.pace import MachinePace

    base = make_profile()
    m = MachinePace({"qci/1/1": 2.0, "qci/1/1@4k+": 3.0}, reuse_per_row=0.25, per_batch=2.0)
    assert m.pace("qci/1/1", 1000) == 2.0 and m.pace("qci/1/1", 5000) == 3.0 and m.pace("kv_dev/1/1", 5000) == 1.0
    paced = m.profile(base, "qci/1/1", 1000)
    patch = paced.layer_costs["patch"]
    assert paced.overhead.intercept_s == pytest.approx(4.0 * base.overhead.intercept_s)  # paced + per batch
    assert patch.per_row_s == pytest.approx(2.0 * base.layer_costs["patch"].per_row_s)
    assert patch.per_aux_s == pytest.approx(2.0 * base.layer_costs["patch"].per_aux_s
                                            + 0.25 * base.layer_costs["patch"].per_row_s)
    assert MachinePace.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert MachinePace.from_dict({"qci/1/1": 2.0}) == MachinePace({"qci/1/1": 2.0})  # a plain pace map
    assert MachinePace.from_dict(None) == MachinePace()


def test_the_planners_price_learns_a_steady_machine_after_one_batch_and_keeps_kinds_apart():
    from cachesmith.bench.pace import paced_errors

    def batch(plan, predicted, measured, num_tokens=1500):
        return {"plan": plan, "num_tokens": num_tokens, "predicted_s": predicted, "measured_s": measured}

    # the machine runs kv_dev plans 1.25x slower than predicted, qci probe plans 0.8x
    batches = [batch("(kv_dev,1,1,30%)", 1.0, 1.25), batch("(kv_dev,1,1,50%)", 2.0, 2.5),
               batch("(qci,0,1,15%)", 1.0, 0.8), batch("(qci,0,1,15%)", 1.0, 0.8), batch("(qci,0,1,15%)", 1.0, 0.8),
               batch("(kv_dev,1,1,30%)", 1.0, 1.25)]
    errs = paced_errors(batches)
    assert errs[0] == pytest.approx(1.0 / 1.25 - 1)  # nothing learned yet: the raw model's error
    assert errs[1] == pytest.approx(0.0)  # the machine's pace, learned from the first batch
    # the first qci batch reads the machine's pace (kv_dev's 1.25) and errs; later ones learn qci's own
    assert errs[2] == pytest.approx(1.25 / 0.8 - 1)
    assert abs(errs[4]) < abs(errs[3]) < abs(errs[2])
    assert abs(errs[5]) < 0.1  # kv_dev's own level still holds its pace after the qci batches
