"""The profile file: round trip, and every mismatch named instead of a silently wrong plan."""
from __future__ import annotations

import json

import pytest

from cachesmith.planner import Profile, ProfileError
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.profile import NEVER, DemandCurve
from tests.planner.synthetic_profile import make_profile


def test_round_trip_keeps_never_and_costs(tmp_path):
    profile = make_profile()
    assert any(NEVER in c.demands for c in profile.demand)
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json", "fp-test", "float32", "cpu")
    assert again == profile


@pytest.mark.parametrize("kwargs, match", [
    ({"model_fingerprint": "other"}, "model 'fp-test', not 'other'"),
    ({"dtype": "bfloat16"}, "dtype 'float32', not 'bfloat16'"),
    ({"device": "cuda"}, "device 'cpu', not 'cuda'"),
])
def test_profile_of_another_model_dtype_or_device(tmp_path, kwargs, match):
    make_profile().save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match=match):
        Profile.load(tmp_path / "p.json", **kwargs)


def test_other_format_version_and_malformed_files(tmp_path):
    path = tmp_path / "p.json"
    make_profile().save(path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(ProfileError, match="format_version 99"):
        Profile.load(path)
    del data["layer_costs"]["patch"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="patch"):
        Profile.load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="missing.json"):
        Profile.load(tmp_path / "missing.json")


def test_demand_interpolates_between_anchor_depths():
    curves = (DemandCurve("qci", 2, (0.4, 0.4, NEVER, 0.0)), DemandCurve("qci", 10, (0.1, 0.1, NEVER, 0.0)))
    model = DemandModel(curves)
    assert model.pass_probability("qci", 2, [0.2])[0] == 0.25  # only the 0% request
    assert model.pass_probability("qci", 10, [0.2])[0] == 0.75
    assert model.pass_probability("qci", 6, [0.2])[0] == pytest.approx(0.5)  # halfway
    assert model.pass_probability("qci", 40, [1.0])[0] == 0.75  # NEVER never passes; clamped depth
    assert model.quantile("qci", 2, 0.5) == 0.4 and model.quantile("qci", 2, 0.9) == float("inf")
    with pytest.raises(ProfileError, match="no demand distribution for signal 'kv_dev'"):
        model.cdf("kv_dev", 4)


def test_requests_that_fail_again_make_the_pass_probability_dip_and_survive_a_round_trip(tmp_path):
    # request 0 passes from 10%; request 1 passes below 30% only (full prefill fails it);
    # request 2 from 50%; request 3 never
    curve = DemandCurve("kv_dev", 2, (0.1, 0.0, 0.5, NEVER), None, (NEVER, 0.3, NEVER, NEVER))
    model = DemandModel((curve,))
    assert model.pass_probability("kv_dev", 2, [0.0, 0.1, 0.3, 0.5, 1.0]).tolist() == [0.25, 0.5, 0.25, 0.5, 0.5]
    # without `until` the same demands rise only
    rising = DemandModel((DemandCurve("kv_dev", 2, curve.demands),))
    assert rising.pass_probability("kv_dev", 2, [0.0, 0.3]).tolist() == [0.25, 0.5]
    profile = make_profile()
    profile = Profile(**{**profile.__dict__, "demand": (*profile.demand, curve)})
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").demand[-1] == curve
    data = json.loads((tmp_path / "p.json").read_text())
    data["demand"][-1]["until"] = [None]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="1 `until` values for 4 requests"):
        Profile.load(tmp_path / "p.json")
