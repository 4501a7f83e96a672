"""A measured profile that cannot be used (older format, another model/dtype/device, missing fields,
corrupt JSON) is named in a warning and the packaged profile serves instead, rescaled; never a
traceback. No model is loaded: a stand-in pipeline carries the packaged model's identity."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cachesmith.planner import Profile, ProfileError
from cachesmith.planner.profile import PROFILE_FORMAT
from cachesmith.calibration import packaged
from cachesmith.calibration.packaged import PACKAGED_DIR, find_profile, measured_or_packaged
from cachesmith.kvstore import StoreConfig

SHIPPED = PACKAGED_DIR / "smollm2-135m-float32-cpu.json"


def _pipe(name: str = "smollm2-135m", dtype=torch.float32, fingerprint: str | None = None, num_layers: int = 30,
          num_kv_heads: int = 3):
    fingerprint = fingerprint or json.loads(SHIPPED.read_text())["model_fingerprint"]
    model = SimpleNamespace(fingerprint=fingerprint, dtype=dtype, device=torch.device("cpu"), model_dir=Path(name),
                            num_layers=num_layers, config=SimpleNamespace(num_kv_heads=num_kv_heads, head_dim=64))
    return SimpleNamespace(model=model, store=SimpleNamespace(config=StoreConfig()))


@pytest.fixture
def own(tmp_path, monkeypatch):
    """Where `cachesmith profile` would have written this machine's profile (a fresh home)."""
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))
    path = tmp_path / "home" / "profiles" / SHIPPED.name
    path.parent.mkdir(parents=True)
    return path


def _measured(**changes) -> dict:
    data = json.loads(SHIPPED.read_text())
    data["layer_costs"]["full"]["per_row_s"] *= 3  # tell it apart from the packaged one
    return {**data, **changes}


def _without(field: str) -> dict:
    data = _measured()
    del data[field]
    return data


@pytest.mark.parametrize("content, fault", [
    (json.dumps(_measured(format_version=0)), rf"format_version 0, this cachesmith reads {PROFILE_FORMAT}"),
    (json.dumps(_measured(model_fingerprint="0" * 32)), r"measured for model '0{32}', not 'f4c0dd9a"),
    (json.dumps(_measured(dtype="bfloat16")), r"measured for dtype 'bfloat16', not 'float32'"),
    (json.dumps(_measured(device="cuda")), r"measured for device 'cuda', not 'cpu'"),
    (json.dumps(_without("layer_costs")), r"missing field\(s\) layer_costs"),
    (json.dumps(_without("format_version")), r"format_version None"),
    (json.dumps(_measured(extra_field=1)), r"unknown field\(s\) extra_field"),
    (json.dumps(_measured())[:200], r"not valid JSON, truncated or corrupt"),
    ("[1, 2]", r"holds a JSON list, not an object"),
], ids=["old_format", "other_model", "other_dtype", "other_device", "missing_field", "no_version",
        "unknown_field", "truncated_json", "not_an_object"])
def test_unusable_measured_profile_falls_back_to_packaged(own, caplog, content, fault):
    own.write_text(content)
    with caplog.at_level(logging.WARNING, logger="cachesmith.calibration.packaged"):
        profile, source = find_profile(_pipe())
    assert source == "packaged" and profile == Profile.load(SHIPPED)
    assert str(own) in caplog.text and "falling back to the packaged profile" in caplog.text
    assert re.search(fault, caplog.text), caplog.text


def test_usable_measured_profile_is_used_and_missing_one_is_quietly_packaged(own, caplog):
    with caplog.at_level(logging.WARNING):
        assert find_profile(_pipe())[1] == "packaged"  # never profiled: the normal case, no warning
        own.write_text(json.dumps(_measured()))
        profile, source = find_profile(_pipe())
    assert source == "measured" and profile.layer_costs["full"] != Profile.load(SHIPPED).layer_costs["full"]
    assert caplog.text == ""


def test_served_fallback_is_rescaled_to_this_machine(own, monkeypatch):
    from cachesmith.server.service import serving_profile

    own.write_text(json.dumps(_measured(format_version=0)))
    # a machine half as fast at full layers, a third as fast on the reuse path
    monkeypatch.setattr(packaged, "calibrate", lambda pipe, profile: packaged.SpeedFactors(2.0, 3.0))
    profile, source = serving_profile(_pipe())
    shipped = Profile.load(SHIPPED)
    assert source == "packaged (speed factor 2.00, reuse 3.00)"
    assert profile.layer_costs["full"].per_row_s == pytest.approx(2.0 * shipped.layer_costs["full"].per_row_s)
    assert profile.layer_costs["patch"].per_row_s == pytest.approx(3.0 * shipped.layer_costs["patch"].per_row_s)


def test_no_usable_profile_and_none_packaged_names_both(tmp_path):
    own = tmp_path / "tiny-llama-float32-cpu.json"
    own.write_text("{")
    with pytest.raises(ProfileError, match=r"not valid JSON.*none is packaged for tiny-llama-float32-cpu"):
        measured_or_packaged(own)
    with pytest.raises(ProfileError, match=r"no measured profile at .*none is packaged"):
        measured_or_packaged(tmp_path / "other.json")


def test_explicit_profile_path_must_be_usable(tmp_path):
    path = tmp_path / "given.json"
    path.write_text(json.dumps(_measured(format_version=0)))
    with pytest.raises(ProfileError, match="format_version 0"):
        find_profile(_pipe(), path)


def test_packaged_profile_of_another_identity_serves_a_model_of_the_same_architecture(own, caplog):
    with caplog.at_level(logging.WARNING, logger="cachesmith.calibration.packaged"):
        profile, source = find_profile(_pipe(fingerprint="1" * 32))
    assert source == "packaged" and profile == Profile.load(SHIPPED)
    shipped_id = Profile.load(SHIPPED).model_fingerprint
    assert f"measured for model {shipped_id}, the loaded model is {'1' * 32}" in caplog.text
    assert "architecture is the same (30 layers, 1536 KV bytes" in caplog.text


@pytest.mark.parametrize("num_layers, num_kv_heads", [(12, 3), (30, 5)], ids=["layers", "kv_heads"])
def test_packaged_profile_of_another_architecture_measures_costs_now(own, caplog, monkeypatch, num_layers,
                                                                     num_kv_heads):
    calls = []

    def costs_profile(pipe, config, out, demand_from):
        calls.append((config, out, demand_from))
        return Profile.load(SHIPPED)

    monkeypatch.setattr(packaged, "run_costs_profile", costs_profile)
    pipe = _pipe(fingerprint="2" * 32, num_layers=num_layers, num_kv_heads=num_kv_heads)
    with caplog.at_level(logging.WARNING, logger="cachesmith.calibration.packaged"):
        profile, source = find_profile(pipe)
    assert source == "measured" and calls == [(packaged.QUICK_COSTS, own, SHIPPED)]
    assert f"the loaded model has {num_layers}, {2 * num_kv_heads * 64 * 4}" in caplog.text
    assert "measuring this model's costs now" in caplog.text and str(own) in caplog.text


def test_a_store_that_encodes_its_kv_plans_with_its_own_profile_where_there_is_one(own, tmp_path, monkeypatch,
                                                                                    caplog):
    """Demand measured on decoded KV (`cachesmith profile --kv-codec int8`) is kept apart; without
    it, and with none packaged for the codec, the exact store's profile serves, and the log says how
    to measure the codec's."""
    shelf = tmp_path / "data"  # the exact profile packaged, none for the codec
    shelf.mkdir()
    (shelf / SHIPPED.name).write_text(SHIPPED.read_text())
    monkeypatch.setattr(packaged, "PACKAGED_DIR", shelf)
    coded = _pipe()
    coded.store.config = StoreConfig(codec="int8")
    with caplog.at_level(logging.INFO, logger="cachesmith.calibration.packaged"):
        profile, source = find_profile(coded)
    assert source == "packaged" and profile == Profile.load(SHIPPED)
    assert "no profile measured with the int8 codec" in caplog.text and "--kv-codec int8" in caplog.text
    own.write_text(json.dumps(_measured()))  # the exact store's measured profile: not the codec's
    assert find_profile(coded)[0] == Profile.load(own)
    own.with_name(own.stem + "-int8.json").write_text(json.dumps(_measured(entropy_threshold=0.123)))
    profile, source = find_profile(coded)
    assert source == "measured" and profile.entropy_threshold == 0.123
    assert find_profile(_pipe())[0].entropy_threshold != 0.123  # the exact store keeps its own


def test_a_codec_profile_packaged_beside_the_exact_one_serves_a_store_that_encodes(own, tmp_path, monkeypatch, caplog):
    """A packaged profile for the codec (`<model>-<dtype>-<device>-int8.json`) serves where none was
    measured, as the packaged exact one does; a measured codec profile still comes first, and an
    unusable one is named before the packaged one serves."""
    shelf = tmp_path / "data"
    shelf.mkdir()
    (shelf / SHIPPED.name).write_text(SHIPPED.read_text())
    (shelf / (SHIPPED.stem + "-int8.json")).write_text(json.dumps(_measured(entropy_threshold=0.321)))
    monkeypatch.setattr(packaged, "PACKAGED_DIR", shelf)
    coded = _pipe()
    coded.store.config = StoreConfig(codec="int8")
    profile, source = find_profile(coded)
    assert source == "packaged" and profile.entropy_threshold == 0.321
    assert find_profile(_pipe())[0].entropy_threshold != 0.321  # the exact store keeps the exact one
    measured = own.with_name(own.stem + "-int8.json")
    measured.write_text(json.dumps(_measured(entropy_threshold=0.123)))
    assert find_profile(coded)[0].entropy_threshold == 0.123
    measured.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="cachesmith.calibration.packaged"):
        profile, source = find_profile(coded)
    assert source == "packaged" and profile.entropy_threshold == 0.321
    assert str(measured) in caplog.text or "falling back to the packaged profile" in caplog.text
    measured.unlink()
    # another model: the packaged codec profile serves one of the same architecture only
    same = _pipe(fingerprint="0" * 32)
    same.store.config = StoreConfig(codec="int8")
    assert packaged._codec_profile(same, packaged._key(same))[0].entropy_threshold == 0.321
    other = _pipe(fingerprint="0" * 32, num_layers=4)
    other.store.config = StoreConfig(codec="int8")
    assert packaged._codec_profile(other, packaged._key(other)) is None
