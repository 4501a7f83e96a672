"""The connector's worker without vLLM (`integrations.connector_worker`), on a tiny random-weight
model: it loads cachesmith's decoder on the registered caches' device and dtype (on a CUDA device,
simulated or a GPU's, every weight lives there), writes each prompt's KV where vLLM's backend reads
it (the rows read back equal the pipeline's own build, and equal on the CPU and each device of the
`device` fixture, as does the next token decoded from them), and refuses caches that do not fit its
model by name."""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import pytest
import torch

from cachesmith.integrations import connector_worker
from cachesmith.integrations.connector_book import Load, StoreSettings
from cachesmith.integrations.connector_worker import ConnectorWorker
from cachesmith.integrations.prompt_kv import ConnectorParams, build_prompt_kv
from cachesmith.plan_one import use_profile
from cachesmith.testing.sim_cuda import active
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.integrations.paged_layouts import Pool
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

INST = instance(5)
BLOCK_SIZE, NUM_BLOCKS = 16, 40
BLOCK_IDS = [31, 4, 17, 9, 26, 12, 38, 1, 20, 7, 35, 14]  # scattered: enough blocks for the prompt


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), weight_std=0.3)


@pytest.fixture(autouse=True)
def synthetic_profile(monkeypatch):
    # the worker plans with the pipeline's serving profile; a tiny model takes a synthetic one
    def planner(pipe):
        return use_profile(pipe, make_profile(num_layers=pipe.model.num_layers), "synthetic")
    monkeypatch.setattr(connector_worker, "one_planner", planner)


def prompt_load(pipe, method: str) -> Load:
    parts = pipe.prompt(INST.documents, INST.question)
    params = ConnectorParams.parse({"num_prefix_tokens": len(parts.prefix_ids), "method": method,
                                    "chunk_token_counts": [len(c) for c in parts.chunk_ids]}, len(parts.token_ids))
    n = len(parts.token_ids) - 1
    assert len(BLOCK_IDS) * BLOCK_SIZE >= n
    return Load("req-1", parts.token_ids, params, "", time.time(), BLOCK_IDS[:-(-n // BLOCK_SIZE)], n)


def worker_run(tiny_dir, tmp_path, device: str, method: str, layout="LBNHC", dtype=torch.float32):
    """(worker, the pool its caches live in, the load, its Built)."""
    worker = ConnectorWorker(str(tiny_dir), StoreSettings(("memory",), str(tmp_path / "kv")), BLOCK_SIZE)
    cfg_pipe = tiny_pipeline(tiny_dir, tmp_path / "ref")
    cfg = cfg_pipe.model.config
    pool = Pool(layout, cfg.num_layers, NUM_BLOCKS, cfg.num_kv_heads, BLOCK_SIZE, cfg.head_dim, dtype, device)
    worker.registration = worker.register(pool.caches("FLASH_ATTN", cfg.num_kv_heads))
    load = prompt_load(cfg_pipe, method)
    return worker, pool, load, worker.build(load, None)


def read_back(pool: Pool, load: Load, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, num_rows, Hkv, D] as FlashAttention reads the request's blocks."""
    reads = [pool.read(i, load.block_ids, load.num_rows) for i in range(num_layers)]
    return torch.stack([k for k, _ in reads]), torch.stack([v for _, v in reads])


def next_token(pipe, keys: torch.Tensor, values: torch.Tensor, last_token: int) -> int:
    """The greedy token after the prompt, decoded on the CPU over the rows read back."""
    num_layers, n = keys.shape[:2]
    cache = pipe.model.new_cache(n + 1)
    for i in range(num_layers):
        cache.write(i, 0, keys[i], values[i])
    cache.num_tokens = n
    hidden = pipe.model.extend([last_token], cache)
    return int(pipe.model.head(hidden[-1:])[0].argmax())


@pytest.mark.parametrize("method", ["cacheblend@0.15", "full_reuse"])
def test_the_rows_written_are_the_pipelines_own_build(tiny_dir, tmp_path, method):
    worker, pool, load, built = worker_run(tiny_dir, tmp_path, "cpu", method)
    keys, values = read_back(pool, load, worker.pipe.model.num_layers)
    ref = tiny_pipeline(tiny_dir, tmp_path / "ref2")
    kv = build_prompt_kv(ref, load.token_ids, load.params)
    n = load.num_rows
    assert torch.equal(keys, kv.cache.key_slab[:, :n]) and torch.equal(values, kv.cache.value_slab[:, :n])
    assert built.params["cachesmith"]["plan"] == kv.report.plan and built.counts["written_tokens"] == n
    kv.cache.release()


def test_on_each_device_the_build_lives_there_and_equals_the_cpus(tiny_dir, tmp_path, device):
    cpu, cpu_pool, load, cpu_built = worker_run(tiny_dir, tmp_path / "cpu", "cpu", "cacheblend@0.15")
    cpu_keys, cpu_values = read_back(cpu_pool, load, cpu.pipe.model.num_layers)
    sim = active()  # the simulated device also counts what a GPU would pay for
    with (sim.count() if sim else nullcontext()) as counts:
        worker, pool, _, built = worker_run(tiny_dir, tmp_path / "on", device, "cacheblend@0.15")
    if sim:
        assert counts.findings == [] and counts.attention["math"] == 0
    expected = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    assert worker.pipe.model.device == expected
    assert {t.device for t in worker.pipe.model.weight_tensors()} == {expected}  # no host copy
    keys, values = read_back(pool, load, worker.pipe.model.num_layers)
    assert built.params == cpu_built.params  # the same plan, chunks and rows
    torch.testing.assert_close(keys, cpu_keys, rtol=0, atol=1e-4)
    torch.testing.assert_close(values, cpu_values, rtol=0, atol=1e-4)
    last = load.token_ids[-1]
    assert next_token(cpu.pipe, keys, values, last) == next_token(cpu.pipe, cpu_keys, cpu_values, last)


def test_the_decoder_takes_the_caches_dtype(tiny_dir, tmp_path):
    worker, pool, load, _ = worker_run(tiny_dir, tmp_path, "cpu", "full_reuse", layout="BHLNC",
                                       dtype=torch.bfloat16)
    assert worker.pipe.model.dtype == torch.bfloat16 and worker.registration.dtype == "bfloat16"
    assert worker.registration.lines()[1] == "CachesmithConnector: writers: layers 0-3: index write by slot (FLASH_ATTN)"
    # 4 layers of 64-wide norms, 128 x 64 QKV, 64 x 64 out, 256 x 64 gate+up, 64 x 128 down; a tied head
    num_params = 49152 * 64 + 64 + 4 * (2 * 64 + 128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    assert worker.registration.weights_gb == pytest.approx(2 * num_params / 1e9)
    keys, _ = read_back(pool, load, worker.pipe.model.num_layers)
    assert keys.dtype == torch.bfloat16 and bool(keys.abs().sum(dim=(-1, -2)).gt(0).all())  # every row written


def test_caches_that_do_not_fit_the_model_are_refused_by_name(tiny_dir, tmp_path):
    worker = ConnectorWorker(str(tiny_dir), StoreSettings(("memory",)), BLOCK_SIZE)
    pool = Pool("LBHNC", 3, 4, 2, BLOCK_SIZE, 16)  # the model has 4 layers
    with pytest.raises(ValueError, match=r"has 4 layers of 2 KV heads x 16; vLLM's caches are layers 0-2 of "
                                         r"\[\(2, 16\)\]: extra config 'model' must name the weights vLLM serves"):
        worker.register(pool.caches("FLASH_ATTN", 2))
    mixed = Pool("LBHNC", 2, 4, 2, BLOCK_SIZE, 16).caches("FLASH_ATTN", 2)
    half = Pool("LBHNC", 2, 4, 2, BLOCK_SIZE, 16, torch.float16).caches("FLASH_ATTN", 2)
    with pytest.raises(ValueError, match="the connector builds on one device in one dtype"):
        worker.register([mixed[0], half[1]])
    with pytest.raises(RuntimeError, match="a build before vLLM registered its KV caches"):
        ConnectorWorker(str(tiny_dir), StoreSettings(("memory",)), BLOCK_SIZE).build(None, None)


def test_no_room_for_the_weights_says_which_flag_to_lower(tiny_dir, monkeypatch):
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr("cachesmith.pipeline.RagPipeline", no_room)
    caches = Pool("LBHNC", 4, 4, 2, BLOCK_SIZE, 16).caches("FLASH_ATTN", 2)
    with pytest.raises(MemoryError, match="no room on cpu for .* in float32 beside vLLM's KV cache; lower "
                                          "--gpu-memory-utilization"):
        ConnectorWorker(str(tiny_dir), StoreSettings(("memory",)), BLOCK_SIZE).register(caches)


@pytest.mark.sim_cuda
def test_the_build_gives_its_slabs_back_after_its_stream_read_them(tiny_dir, tmp_path, sim_cuda, monkeypatch):
    """A slab a build gives back may be taken at once by another build (here, on the default
    stream): the build's stream has read it into vLLM's cache, so that taker must come after it."""
    worker, _pool, load, _built = worker_run(tiny_dir, tmp_path, "cuda", "cacheblend@0.15")
    pool = worker.pipe.model.kv_pool
    give, taken = pool.give, []

    def give_then_take(slab):
        give(slab)
        # the next build, on another thread (so on the default stream), takes it at once
        thread = threading.Thread(target=lambda: taken.append(
            pool.take(tuple(slab.shape), slab.device, slab.dtype).fill_(0.0)))
        thread.start()
        thread.join()
    monkeypatch.setattr(pool, "give", give_then_take)
    with sim_cuda.count() as counts:
        worker.build(load, None)
    assert taken and counts.stream_findings == []
