"""Shared fixtures: tiny random-weight HF models saved to disk, the packaged real model, redis-servers,
and the devices a test runs on."""
from __future__ import annotations

import pytest
import torch

from tests.redis_server import start_redis
from tests.tiny_models import TINY_ARCHITECTURES, save_tiny_model


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_model_dir(request, tmp_path_factory):
    """A tiny random model of each supported architecture, with its HF reference model."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = save_tiny_model(request.param, path)
    return path, hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-only")
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="session")
def real_model():
    """The packaged SmolLM2-135M (fetched on first use) loaded in float32 on CPU."""
    from cachesmith.model import Decoder, Tokenizer, resolve_model

    path = resolve_model("smollm2-135m")
    return Decoder(path, "cpu", torch.float32), Tokenizer(path)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server shared by the session's tests (entries are content-addressed, so tests
    do not collide), stopped after the session."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture()
def redis_server(tmp_path):
    """A redis-server of this test's own, which the test may stop (an outage) before the end."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


# "cuda" only where torch sees a GPU, so a run without one neither collects nor skips it; it carries
# the `cuda` mark, so `make test-cuda` (pytest -m cuda) selects exactly the GPU cases.
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device a test should pass on: "cpu", and "cuda" where there is one."""
    return request.param
