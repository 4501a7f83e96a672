"""Pace per plan family, measured on a tiny random model against a profile of its layer count."""
from __future__ import annotations

import json

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
    assert {"position/1/0", "position/0/0", "kv_dev/1/0", "kv_dev/1/1", "qci/1/1", "qci/0/1", "qci_last/0/1"} == set(paces)
    assert all(v > 0 for v in paces.values())
    saved = json.loads(out.read_text())
    assert all(len(v) == 2 * sum(family(p.signal.value, p.warmup, p.probe) == k for p in plans)
               for k, v in saved["ratios"].items())
    assert measure_paces(None, profile, [], out) == paces  # cached: nothing measured again


def test_traced_paces_override_isolated_ones_and_set_the_level_of_the_rest():
    from cachesmith.bench.pace import combine_paces

    isolated = {"kv_dev/1/1": 0.8, "qci/1/1": 1.0, "position/1/0": 0.5}
    traced = {"kv_dev/1/1@1": [1.0, 1.0, 1.0], "kv_dev/1/1@2+": [1.5, 1.6, 1.4], "qci/1/1@1": [1.25] * 3,
              "qci/1/1@2+": [9.0, 9.0]}  # two batches: too few to trust
    paces = combine_paces(isolated, traced)
    assert paces["kv_dev/1/1"] == 1.0 and paces["kv_dev/1/1@2+"] == 1.5 and paces["qci/1/1"] == 1.25
    assert "qci/1/1@2+" not in paces
    assert paces["position/1/0"] == 0.5 * 1.25  # the traced/isolated level, 1.25 for both families
