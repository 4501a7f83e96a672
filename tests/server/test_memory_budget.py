"""Memory sized to the machine: on a faked small machine the KV capacity, slab pool and memory tier
shrink by the stated rule, explicit sizes win, a configuration that cannot fit is refused at start
with its numbers, and a served request larger than the resulting KV capacity gets the existing 400."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from cachesmith.cli import main
from cachesmith.engine import EngineConfig
from cachesmith.errors import ConfigError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.tiers import MemoryTier
from cachesmith.model import ModelConfig
from cachesmith.model import device as accel
from cachesmith.model.config import load_hf_config
from cachesmith.model.weights import load_weights
from cachesmith.pipeline import RagPipeline
from cachesmith.scheduler import SchedulerConfig
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.memory_budget import (
    AvailableMemory, ExplicitSizes, kv_bytes_per_token, num_parameters, parse_meminfo, plan_memory,
    human_bytes, read_available, weights_bytes)
from cachesmith.server.run import BackgroundServer
from tests.engine_helpers import WORDS, save_tiny_chat_model
from tests.server.conftest import NAME, tiny_profile

GB = 10 ** 9
GIB = 1 << 30
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
# the packaged model's shape (smollm2-135m's config.json)
SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 8192, True, False, False)
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # 46,080 bytes of float32 K and V
WEIGHTS = 3 * 538_060_032  # float32 weights, kept three times on the CPU (docs/models.md)


def machine(host_bytes: int, device_bytes: int | None = None):
    return lambda device: AvailableMemory(host_bytes, device_bytes, "faked")


def plan(host_bytes: int, device=CPU, device_bytes=None, **explicit):
    return plan_memory(SMOLLM2, torch.float32, device, AvailableMemory(host_bytes, device_bytes, "faked"),
                       ExplicitSizes(**explicit))


def test_weights_and_kv_per_token_follow_the_model(tmp_path):
    assert num_parameters(SMOLLM2) * 4 == 538_060_032  # the packaged float32 weights' bytes
    assert weights_bytes(SMOLLM2, torch.float32, CPU) == WEIGHTS
    assert weights_bytes(SMOLLM2, torch.bfloat16, CUDA) == 538_060_032 // 2  # one copy on a GPU
    assert kv_bytes_per_token(SMOLLM2, torch.float32) == PER_TOKEN
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    config = ModelConfig.from_hf(load_hf_config(model_dir))
    w = load_weights(model_dir, config, CPU, torch.float32)
    loaded = {id(t): t.numel() for t in (w.embed, w.head, w.norm, *(t for layer in w.layers for t in layer.values()))}
    assert num_parameters(config) == sum(loaded.values())  # the tied head counted once


@pytest.mark.parametrize("host_bytes", [8 * GB, 2 * GB])
def test_a_small_machine_shrinks_the_defaults_by_the_rule(host_bytes):
    budget = plan(host_bytes)
    left = host_bytes - WEIGHTS
    assert budget.weights_bytes == WEIGHTS and budget.available_bytes == host_bytes
    assert budget.kv_capacity_tokens == int(0.40 * left) // PER_TOKEN < 65_536
    assert budget.kv_bytes == budget.kv_capacity_tokens * PER_TOKEN
    assert budget.pool_bytes == int(0.20 * left) < 4 * GIB
    assert budget.tier_bytes == int(0.15 * left) < GIB
    assert budget.headroom_bytes >= 0.25 * left  # activations, decoding caches, the OS
    assert budget.explicit == ()


def test_the_two_machines_give_their_numbers():
    assert plan(8 * GB).kv_capacity_tokens == 55_432
    small = plan(2 * GB)
    assert small.kv_capacity_tokens == 3_349 < SMOLLM2.max_positions  # a full-length prompt is refused
    line = small.describe()
    assert "KV capacity 3,349 tokens = 147.2 MiB (40% of what is left)" in line
    assert "weights 1.5 GiB" in line and "1.9 GiB available (faked)" in line


def test_a_large_machine_keeps_the_fixed_defaults():
    budget = plan(256 * GIB)
    assert (budget.kv_capacity_tokens, budget.pool_bytes, budget.tier_bytes) == (65_536, 4 * GIB, GIB)
    assert "65,536 tokens = 2.8 GiB (its cap)" in budget.describe()


def test_explicit_sizes_win_and_the_rest_share_what_they_leave():
    budget = plan(8 * GB, kv_capacity_tokens=10_000, kv_pool_bytes=123, memory_bytes=1 << 20)
    assert (budget.kv_capacity_tokens, budget.pool_bytes, budget.tier_bytes) == (10_000, 123, 1 << 20)
    assert budget.explicit == ("kv_capacity_tokens", "kv_pool_bytes", "memory_bytes")
    assert "(--kv-capacity)" in budget.describe() and "(--memory-bytes)" in budget.describe()
    only_kv = plan(8 * GB, kv_capacity_tokens=60_000)
    left = 8 * GB - WEIGHTS - 60_000 * PER_TOKEN
    assert only_kv.pool_bytes == int(0.20 * left) and only_kv.tier_bytes == int(0.15 * left)
    assert plan(8 * GB, has_memory_tier=False).tier_bytes == 0  # no memory tier: no memory for it


def test_a_configuration_that_does_not_fit_is_refused_with_its_numbers():
    with pytest.raises(ConfigError) as caught:
        plan(8 * GB, kv_capacity_tokens=200_000, memory_bytes=GIB)
    message = str(caught.value)
    for part in ("--kv-capacity 200,000 tokens 8.6 GiB", "--memory-bytes 1.0 GiB", "the model's weights 1.5 GiB",
                 "= 11.1 GiB", "7.5 GiB available (faked)"):
        assert part in message
    with pytest.raises(ConfigError, match="the model's weights 1.5 GiB = 1.5 GiB, more than the 953.7 MiB"):
        plan(GB)
    with pytest.raises(ConfigError, match="would be 744 tokens .* below 1,024"):
        plan(17 * 10 ** 8)  # fits the weights, leaves too little for a useful KV capacity


def test_on_cuda_kv_and_pool_are_device_memory_and_the_tier_host_memory():
    budget = plan(3 * GB, CUDA, device_bytes=2 * GB)
    left = 2 * GB - 538_060_032
    assert budget.weights_bytes == 538_060_032 and budget.available_bytes == 2 * GB
    assert budget.kv_capacity_tokens == int(0.40 * left) // PER_TOKEN
    assert budget.pool_bytes == int(0.20 * left)
    assert budget.tier_bytes == int(0.15 * (3 * GB))  # from the host: no weights there
    with pytest.raises(ConfigError, match="--memory-bytes 4.0 GiB does not fit in the host's 2.8 GiB"):
        plan(3 * GB, CUDA, device_bytes=2 * GB, memory_bytes=4 * GIB)
    with pytest.raises(ConfigError, match="--kv-pool-bytes 2.0 GiB"):
        plan(3 * GB, CUDA, device_bytes=2 * GB, kv_pool_bytes=2 * GIB)
    with pytest.raises(ConfigError, match="no device memory"):
        plan(3 * GB, CUDA)


def test_available_memory_is_read_from_meminfo_and_the_device_module():
    assert parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 40 kB\n") == (
        40 * 1024, "/proc/meminfo MemAvailable")
    assert parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\n") == (100 * 1024, "/proc/meminfo MemTotal")
    here = read_available(CPU)
    assert here.host_bytes > 0 and here.device_bytes is None and "host RAM" in here.source

    class Gpu:
        def memory_info(self, device):
            return 5 * GB, 8 * GB

    previous = accel.use_backend(Gpu())
    try:
        on_gpu = read_available(CUDA)
    finally:
        accel.use_backend(previous)
    assert on_gpu.device_bytes == 5 * GB and on_gpu.host_bytes > 0 and "cuda:0 free memory" in on_gpu.source
    with pytest.raises(ValueError, match="host"):
        accel.memory_info(CPU)


def test_the_service_config_takes_the_sizes_in_one_place():
    with pytest.raises(ConfigError, match="kv_capacity_tokens=0"):
        ServiceConfig(kv_capacity_tokens=0)
    with pytest.raises(ConfigError, match="engine.scheduler.kv_capacity_tokens=1000"):
        ServiceConfig(engine=EngineConfig(clock="live", scheduler=SchedulerConfig(kv_capacity_tokens=1000)))
    sizes = ServiceConfig(kv_pool_bytes=5, store=StoreConfig(tiers=("disk",), memory_bytes=7)).memory_sizes
    assert sizes == ExplicitSizes(None, 5, 7, has_memory_tier=False)


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory):
    # more positions than the faked machine's KV capacity, so that limit is the one a prompt meets
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-long"), max_positions=4096)


def small_machine(model_dir) -> tuple[int, int]:
    """A faked host leaving 4 MB after the tiny model's weights; the KV capacity that gives."""
    config = ModelConfig.from_hf(load_hf_config(model_dir))
    return weights_bytes(config, torch.float32, CPU) + 4_000_000, int(0.4 * 4_000_000) // kv_bytes_per_token(
        config, torch.float32)


@pytest.mark.real_model
def test_a_service_on_a_small_machine_refuses_a_request_past_its_kv_capacity(long_tiny_dir, tmp_path):
    host_bytes, capacity = small_machine(long_tiny_dir)
    profile = tiny_profile(RagPipeline(str(long_tiny_dir), store=ChunkStore(StoreConfig(tiers=("memory",)))))
    config = ServiceConfig(model=str(long_tiny_dir), served_name=NAME,
                           store=StoreConfig(tiers=("memory", "disk"), root=tmp_path))
    service = Service(config, profile=profile, read_memory=machine(host_bytes))
    assert service.memory.kv_capacity_tokens == capacity == 1562
    assert service.engine.config.scheduler.kv_capacity_tokens == capacity
    assert service.pipeline.model.kv_pool.max_bytes == service.memory.pool_bytes == 800_000
    tier = next(t for t in service.store.tiers if isinstance(t, MemoryTier))
    assert tier.max_bytes == service.memory.tier_bytes == 600_000
    docs = [" ".join(WORDS[(d + i) % len(WORDS)] for i in range(400)) + f" part {d}." for d in range(4)]
    ask = [{"role": "user", "content": "Which word comes after river?"}]
    with BackgroundServer(service, ServerConfig(port=0, log_level="warning")) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as client:
        big = client.post("/v1/chat/completions", json={"model": NAME, "messages": ask, "documents": docs,
                                                        "max_tokens": 4, "slo_ms": 600_000})
        small = client.post("/v1/chat/completions", json={"model": NAME, "messages": ask, "documents": docs[:1],
                                                          "max_tokens": 4, "slo_ms": 600_000})
    assert big.status_code == 400, big.text
    assert f"exceeds the KV capacity of {capacity} tokens" in big.json()["error"]["message"]
    assert small.status_code == 200, small.text


@pytest.mark.real_model
def test_a_given_pipeline_counts_its_memory_tier_as_set(long_tiny_dir):
    pipe = RagPipeline(str(long_tiny_dir), store=ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=GIB)))
    with pytest.raises(ConfigError, match=r"--memory-bytes 1\.0 GiB"):
        Service(ServiceConfig(model=str(long_tiny_dir)), pipe, tiny_profile(pipe), read_memory=machine(512 << 20))


@pytest.mark.real_model  # the tiny model borrows the packaged tokenizer
def test_serve_refuses_at_start_a_configuration_that_cannot_fit(tiny_chat_dir, capsys):
    code = main(["serve", "--model", str(tiny_chat_dir), "--tiers", "memory", "--memory-bytes", "100T"])
    err = capsys.readouterr().err
    assert code == 2
    assert "memory does not fit" in err and "--memory-bytes 100.0 TiB" in err and "available (host RAM" in err


def test_serve_hands_its_memory_flags_to_the_service_config(monkeypatch, capsys):
    seen = []
    budget = plan(8 * GB, kv_capacity_tokens=5000)
    monkeypatch.setattr("cachesmith.server.Service",
                        lambda config: seen.append(config) or SimpleNamespace(profile_source="given", memory=budget,
                                                                              store=SimpleNamespace(tiers=[])))
    monkeypatch.setattr("cachesmith.server.run_server", lambda service, server: None)
    assert main(["serve", "--kv-capacity", "5000", "--kv-pool-bytes", "2G", "--memory-bytes", "512M"]) == 0
    assert (seen[0].kv_capacity_tokens, seen[0].kv_pool_bytes, seen[0].store.memory_bytes) == (5000, 2 * GIB, 512 << 20)
    assert main(["serve"]) == 0
    assert (seen[1].kv_capacity_tokens, seen[1].kv_pool_bytes, seen[1].store.memory_bytes) == (None, None, None)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memory: ")]
    assert lines == [f"memory: {budget.describe()}"] * 2  # one line at each start


# Llama-3-8B's shape (config only: no weights are built)
LLAMA3_8B = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 8192, False, False, False)


def test_the_start_line_on_an_80_gib_device_states_the_decode_graph_buckets():
    """On a simulated 80 GiB device the 8B shape's budget gives the decode graphs their share:
    15% of what the weights (about 15 GiB) leave, under the largest bucket (64 rows x 8,192
    positions = 64 GiB, so a 34 GB bucket of 64 rows x 4,096 does not fit and its steps run
    eager), and the headroom counts them."""
    from cachesmith.testing.sim_cuda import SimCuda

    with SimCuda() as sim:
        assert sim.memory.capacity_bytes == 80 * GIB
        budget = plan_memory(LLAMA3_8B, torch.bfloat16, torch.device("cuda"), read_available(torch.device("cuda")))
    per_token = kv_bytes_per_token(LLAMA3_8B, torch.bfloat16)
    assert per_token == 128 * 1024
    left = budget.available_bytes - budget.weights_bytes
    assert budget.graph_bytes == int(0.15 * left) and 9 * GIB < budget.graph_bytes < 10 * GIB
    assert budget.max_graph_bytes == per_token * 64 * 8192 == 64 * GIB
    assert per_token * 64 * 4096 > budget.graph_bytes  # the 34 GB bucket is not captured
    line = budget.describe()
    assert f"decode graph buckets {human_bytes(budget.graph_bytes)} (15% of what is left)" in line
    used = budget.weights_bytes + budget.kv_bytes + budget.pool_bytes + budget.graph_bytes
    assert budget.headroom_bytes == budget.available_bytes - used
    cpu = plan_memory(LLAMA3_8B, torch.bfloat16, torch.device("cpu"), AvailableMemory(200 * GIB))
    assert cpu.graph_bytes == 0 and "decode graph" not in cpu.describe()
