"""Fixtures for store tests: a tiny model on each device a test should pass on (redis-server:
tests/conftest.py)."""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder
from cachesmith.testing.sim_cuda import SimCuda
from tests.conftest import DEVICES


@pytest.fixture(scope="module")
def loaded_models(tiny_llama_dir):
    """Models of real devices, loaded once per module (device name -> model)."""
    loaded: dict[str, Decoder] = {}

    def get(device: str) -> Decoder:
        if device not in loaded:
            loaded[device] = _eager(Decoder(tiny_llama_dir[0], device))
        return loaded[device]
    return get


@pytest.fixture(params=DEVICES)
def model(tiny_llama_dir, loaded_models, request):
    """The tiny model on each device; on the simulated CUDA device the simulation is on for the
    test (a mode lives no longer than its test, so the model is loaded inside it each time)."""
    if request.param == "sim_cuda":
        with SimCuda():
            yield _eager(Decoder(tiny_llama_dir[0], "cuda"))
    else:
        yield _eager(loaded_models(request.param))


def _eager(model: Decoder) -> Decoder:
    """Staged runs take the eager layer loop; their in-memory references here run it too, so the two
    can be compared bit for bit (a graphed run differs by rounding: test_graph_prefill.py)."""
    model.is_prefill_graphed = False
    return model
