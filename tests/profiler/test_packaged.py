"""Which profile serves, and rescaling one to this machine's speed."""
from __future__ import annotations

import math

import pytest

from cachesmith.planner import BatchShape
from cachesmith.planner.cost_model import CostModel
from cachesmith.profiler.packaged import calibrate, rescaled
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


def test_calibrate_measures_a_finite_positive_factor(tmp_path):
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path / "m"), tmp_path / "kv")
    profile = make_profile(num_layers=pipe.model.num_layers)
    factor = calibrate(pipe, profile, context_tokens=(128, 256))
    assert math.isfinite(factor) and factor > 0
    # measured against a profile 10x slower, the machine looks 10x faster (wide: two timed runs each)
    slower = calibrate(pipe, rescaled(profile, 10.0), context_tokens=(128, 256))
    assert 0.03 < slower / factor < 0.3
