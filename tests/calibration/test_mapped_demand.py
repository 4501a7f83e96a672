"""Demand of another model's profile mapped onto a model's depth: anchor depths move proportionally,
rank depth 1 and the last layer map exactly, nothing lands beyond the model's layers or twice on one
(task, signal, depth); a costs-only profile takes the mapped packaged demand. No model is loaded."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cachesmith.planner import Planner, Profile, ProfileError
from cachesmith.planner.profile import DemandCurve
from cachesmith.calibration import cost_run as run_mod
from cachesmith.calibration.mapped_demand import (REFERENCE_PROFILE, map_demand_depths, mapped_depth,
                                               read_demand_source)
from cachesmith.kvstore import StoreConfig
from tests.planner.synthetic_profile import make_profile

SHIPPED = read_demand_source(REFERENCE_PROFILE)  # smollm2-135m: 30 layers


@pytest.mark.parametrize("num_layers, expected", [
    # depth of 30 -> depth of L: 1 and 30 exactly, anchors round(d * L / 30), at least 2
    (4, {1: 1, 2: 2, 6: 2, 15: 2, 30: 4}),
    (30, {1: 1, 2: 2, 6: 6, 15: 15, 30: 30}),
    (32, {1: 1, 2: 2, 6: 6, 15: 16, 30: 32}),
    (80, {1: 1, 2: 5, 6: 16, 15: 40, 30: 80}),
    (1, {1: 1, 2: 1, 6: 1, 15: 1, 30: 1}),
])
def test_mapped_depth(num_layers, expected):
    assert {d: mapped_depth(d, 30, num_layers) for d in expected} == expected
    assert mapped_depth(45, 30, num_layers) == num_layers  # a depth beyond the source's layers: its last


@pytest.mark.parametrize("num_layers", [1, 2, 4, 12, 30, 32, 80])
def test_packaged_demand_mapped_onto_any_depth_fits_it(num_layers):
    curves, theta = SHIPPED.onto(num_layers)
    assert theta == SHIPPED.entropy_threshold
    assert all(1 <= c.rank_depth <= num_layers for c in curves)
    keys = Counter((c.task, c.signal, c.rank_depth) for c in curves)
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    # every (task, signal) the packaged profile measured keeps at least one curve
    assert {(c.task, c.signal) for c in curves} == {(c.task, c.signal) for c in SHIPPED.curves}
    fixed = {c.signal: c.rank_depth for c in curves if c.task is None and c.signal in ("qci_last", "fused")}
    assert fixed == {"qci_last": num_layers, "fused": num_layers}
    profile = replace(make_profile(num_layers=num_layers), demand=curves)
    assert 1 in Planner(profile).signal_depths("kv_dev")  # CacheBlend's (1, 0) stays searchable


def test_mapping_onto_the_same_depth_is_the_identity():
    assert SHIPPED.onto(30)[0] == SHIPPED.curves


def _curve(shipped_depth: int, signal: str = "kv_dev") -> DemandCurve:
    return next(c for c in SHIPPED.curves if c.task is None and c.signal == signal and c.rank_depth == shipped_depth)


def test_colliding_depths_keep_the_curve_measured_closest():
    curves, _ = SHIPPED.onto(4)
    mix_kv = {c.rank_depth: c for c in curves if c.task is None and c.signal == "kv_dev"}
    # 2, 6 and 15 of 30 all land on 2 of 4 (50%): 15 of 30 (50%) is the closest
    assert sorted(mix_kv) == [1, 2] and mix_kv[2].demands == _curve(15).demands
    assert mix_kv[1].demands == _curve(1).demands  # depth 1 maps exactly, never replaced
    curves, _ = SHIPPED.onto(12)
    mix_qci = {c.rank_depth: c for c in curves if c.task is None and c.signal == "qci"}
    # 2 and 6 of 30 land on 2 of 12 (17%): 6 of 30 (20%) is closer than 2 of 30 (7%); 15 of 30 on 6
    assert sorted(mix_qci) == [2, 6]
    assert mix_qci[2].demands == _curve(6, "qci").demands and mix_qci[6].demands == _curve(15, "qci").demands


def test_mapping_keeps_curves_in_their_order_and_names_bad_layers():
    curves = (DemandCurve("qci", 10, (0.2,)), DemandCurve("kv_dev", 1, (0.3,)), DemandCurve("qci", 3, (0.1,)))
    assert [(c.signal, c.rank_depth) for c in map_demand_depths(curves, 10, 20)] == [
        ("qci", 20), ("kv_dev", 1), ("qci", 6)]
    with pytest.raises(ProfileError, match="layers must be >= 1"):
        map_demand_depths(curves, 10, 0)


def test_unreadable_demand_source_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"demand": []}')
    with pytest.raises(ProfileError, match=rf"profile {path}: no readable demand distributions \(KeyError"):
        read_demand_source(path)


def _stub_pipe(name: str, num_layers: int):
    model = SimpleNamespace(model_dir=Path(name), dtype=torch.float32, device=torch.device("cpu"),
                            num_layers=num_layers)
    return SimpleNamespace(model=model, store=SimpleNamespace(config=StoreConfig()))


@pytest.mark.parametrize("num_layers", [4, 80])
def test_costs_only_profile_maps_the_packaged_demand_by_default(tmp_path, monkeypatch, num_layers):
    measured = replace(make_profile(num_layers=num_layers), demand=(), entropy_threshold=0.5)
    monkeypatch.setattr(run_mod, "base_profile", lambda pipe, config, out, show: (measured, {
        "ttft_rel_err_mean": 0.04, "ttft_rel_err_max": 0.1, "rows": []}))
    pipe = _stub_pipe("tiny-unprofiled", num_layers)
    assert run_mod.demand_source_path(pipe) == REFERENCE_PROFILE  # nothing packaged for this name
    out = tmp_path / "p.json"
    profile = run_mod.run_costs_profile(pipe, run_mod.ProfileConfig(num_requests=1), out, show_progress=False)
    assert profile.demand == SHIPPED.onto(num_layers)[0] and profile.entropy_threshold == SHIPPED.entropy_threshold
    assert max(c.rank_depth for c in profile.demand) == num_layers and Profile.load(out) == profile
    # a given demand source is mapped too: the packaged file's 30-layer depths never reach a 4-layer profile
    again = run_mod.run_costs_profile(pipe, run_mod.ProfileConfig(num_requests=1), out, demand_from=REFERENCE_PROFILE,
                                      show_progress=False)
    assert again.demand == profile.demand
