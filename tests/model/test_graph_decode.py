"""Decode steps as CUDA graph replays, on the simulated CUDA device (issue 61, item 3).

The sim's graph capture runs the step twice, the second time under capture rules (a host sync or a
copy from pageable host memory raises), and each replay runs it again under the same rules: so the
tokens below being the CPU's shows that the step keeps every input and output in its static
buffers, and the counts show that a replayed step copies nothing in and reads one thing back.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cachesmith.cli import build_parser
from cachesmith.errors import ConfigError
from cachesmith.model import Decoder, graph_decode
from cachesmith.model.generate import Decoding
from cachesmith.model.kv_cache import KVCache, SlabPool
from cachesmith.model.sampling import SamplingParams
from cachesmith.server import ServiceConfig
from cachesmith.testing.sim_backend import CAPTURE_SYNC, SimGraph
from cachesmith.testing.sim_cuda import SimCuda
from tests.model.decoding_runs import BUDGETS, JOIN_AT, NUM_TOKENS, run_with_join

pytestmark = pytest.mark.sim_cuda


def _decode(decoding: Decoding, params: list[SamplingParams] | None = None, on_step=None,
            budgets: list[int] = BUDGETS) -> list[list[int]]:
    """Tokens of the shared run (`decoding_runs.run_with_join`); the caches are read after decoding
    and then released."""
    model = decoding.model
    gens, prompts = run_with_join(decoding, params, on_step, budgets)
    for j, gen in enumerate(gens):  # every cache readable after decoding: its prompt and its tokens
        assert gen.cache.num_tokens == len(prompts[j]) + len(gen.token_ids) - 1
        KEYS.append(gen.cache.view(model.num_layers - 1)[0].float().cpu())
        gen.cache.release()
    return [g.token_ids for g in gens]


KEYS: list[torch.Tensor] = []  # the last layer's keys of each cache `_decode` released, in order


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama_dir):
    """The CPU's eager tokens, per dtype."""
    return {dtype: _decode(Decoding(Decoder(tiny_llama_dir[0], "cpu", dtype))) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_tokens_equal_the_cpu_eager_ones(tiny_llama_dir, cpu_tokens, dtype):
    """Tokens, and each cache as its caller reads it afterwards (moved into the static slab, and
    out again when it left and its row went to the joiner, or still there at the end)."""
    KEYS.clear()
    on_cpu = _decode(Decoding(Decoder(tiny_llama_dir[0], "cpu", dtype)))
    with SimCuda():
        decoding = Decoding(Decoder(tiny_llama_dir[0], "cuda", dtype))
        on_sim = _decode(decoding)
    assert on_sim == on_cpu == cpu_tokens[dtype]
    cpu_keys, sim_keys = KEYS[:4], KEYS[4:]
    for a, b in zip(cpu_keys, sim_keys, strict=True):
        torch.testing.assert_close(b, a, **({} if dtype == "float32" else {"atol": 0.05, "rtol": 0.05}))
    assert [len(t) for t in on_sim] == BUDGETS
    graphs = decoding.graphs
    assert graphs.num_replays == JOIN_AT + NUM_TOKENS - 1  # every step: until the joiner's last
    # 3 rows, 4 and 3 again share the bucket of 4; the joiner alone, its last 3 steps, gets one of 1
    assert graphs.num_captures == 2


def test_every_architecture(tiny_model_dir):
    """Q/K norms (Qwen3), QKV biases (Qwen2) and each one's head layout, in graph steps."""
    on_cpu = _decode(Decoding(Decoder(tiny_model_dir[0], "cpu", "float32")))
    with SimCuda():
        decoding = Decoding(Decoder(tiny_model_dir[0], "cuda", "float32"))
        assert _decode(decoding) == on_cpu
    assert decoding.graphs.num_replays == JOIN_AT + NUM_TOKENS - 1


def test_each_step_is_a_replay_that_neither_syncs_nor_copies_in(tiny_llama_dir, sim_cuda, replay_counts):
    """Replayed: 0 syncs, 0 host -> device copies, 0 copies back, memory-efficient attention only.
    A whole step: its tokens back in one copy and one wait, plus one copy of the inputs where the
    rows changed; nothing else."""
    replays = replay_counts
    steps = []

    def on_step(step: int, decoding: Decoding) -> None:
        rows = list(decoding.active)
        with sim_cuda.count() as c:
            decoding.step()
        steps.append((rows, c))

    model = Decoder(tiny_llama_dir[0], "cuda", "bfloat16")
    _decode(Decoding(model), on_step=on_step)
    assert len(replays) == len(steps) == JOIN_AT + NUM_TOKENS - 1
    for c in replays:
        assert (c.syncs, c.h2d, c.d2h, c.findings) == (0, 0, 0, [])
        assert set(c.attention) == {"cudnn"} and c.attention["cudnn"] == model.num_layers  # bf16 on an H100
    previous = None
    for rows, c in steps:
        is_seated = rows != previous  # first step, a sequence joined or one left
        # a capture synchronizes the device (torch's graph context does); a step that replays does not
        assert (c.h2d, c.d2h, c.syncs, c.findings) == (int(is_seated), 1, 1 + c.captures, []), c
        assert c.sync_sites == [CAPTURE_SYNC] * c.captures + ["event.synchronize"]
        assert c.captures <= int(is_seated)
        previous = rows
    assert sum(c.captures for _, c in steps) == 2  # one bucket of 1 row, then one of 2 when a sequence joins


def test_a_batch_with_no_bucket_decodes_eagerly(tiny_llama_dir, cpu_tokens, monkeypatch):
    """Buckets of 1 and 2 rows only: 3 and 4 sequences step eagerly, 2 (after both short ones
    left) in a graph, and the tokens are the CPU's throughout."""
    monkeypatch.setattr(graph_decode, "BATCH_BUCKETS", (1, 2))
    budgets = [NUM_TOKENS, NUM_TOKENS // 2, NUM_TOKENS, NUM_TOKENS // 2]
    on_cpu = _decode(Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32")), budgets=budgets)
    with SimCuda():
        decoding = Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"))
        on_sim = _decode(decoding, budgets=budgets)
    assert on_sim == on_cpu
    assert on_sim[0] == cpu_tokens["float32"][0]
    graphs = decoding.graphs
    # 3 or 4 rows until the second's and the fourth's budgets end, then the first and third: 3 steps
    assert (graphs.num_captures, graphs.num_replays) == (1, 3)


def test_sampled_rows_step_eagerly_beside_graph_steps(tiny_llama_dir):
    """A seeded sampled row (eager while it decodes) beside greedy ones: the CPU's tokens."""
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(),
              SamplingParams()]
    on_cpu = _decode(Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32")), params)
    with SimCuda():
        decoding = Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"))
        on_sim = _decode(decoding, params)
    assert on_sim == on_cpu
    assert decoding.graphs.num_replays > 0  # after the sampled row left


def test_graphs_can_be_turned_off(tiny_llama_dir, cpu_tokens, monkeypatch):
    with SimCuda():
        model = Decoder(tiny_llama_dir[0], "cuda", "float32")
        assert Decoding(model).graphs is not None  # on by default on CUDA
        model.is_decode_graphed = False
        decoding = Decoding(model)
        assert decoding.graphs is None
        monkeypatch.setattr(SimGraph, "capture", lambda *_: pytest.fail("captured with graphs off"))
        assert _decode(decoding) == cpu_tokens["float32"]
        assert Decoding(model, use_graphs=True).graphs is not None
    assert Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32")).graphs is None  # the CPU path is eager


def test_serve_flag_and_config_field(monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["serve"]).no_cuda_graphs is False
    assert parser.parse_args(["serve", "--no-cuda-graphs"]).no_cuda_graphs is True
    assert ServiceConfig().is_graphed is True
    with pytest.raises(ConfigError, match="is_graphed"):
        ServiceConfig(is_graphed="no")
    seen = []
    monkeypatch.setattr("cachesmith.server.Service",
                        lambda config: seen.append(config) or SimpleNamespace(
                            profile_source="given", memory=SimpleNamespace(describe=lambda: "budget"),
                            store=SimpleNamespace(tiers=[])))
    monkeypatch.setattr("cachesmith.server.run_server", lambda service, server: None)
    args = parser.parse_args(["serve", "--device", "cuda", "--no-cuda-graphs"])
    assert args.func(args) == 0
    assert seen[0].is_graphed is False


@pytest.mark.real_model  # the tiny chat model borrows the packaged tokenizer
def test_the_service_hands_its_switch_to_the_model(tmp_path):
    from tests.engine_helpers import save_tiny_chat_model
    from tests.server.conftest import make_service

    model_dir = save_tiny_chat_model(tmp_path / "chat")
    service = make_service(model_dir, is_graphed=False)
    try:
        assert service.pipeline.model.is_decode_graphed is False
        assert service.pipeline.model.is_prefill_graphed is False
    finally:
        service.close()


def test_a_borrowed_cache_gives_its_lender_s_slab_to_no_pool():
    pool = SlabPool()
    cache = KVCache(2, 2, 4, 8, torch.device("cpu"), torch.float32, pool)
    cache.write(0, 0, torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    cache.num_tokens = 3
    own_bytes = pool.num_bytes
    lent = torch.zeros(2, 5, 2, 16, 4)  # [L, B, Hkv, S, D]: a static slab's row 1 is lent
    cache.borrow(lent[:, 1], lent[:, 1].clone())
    assert pool.num_bytes > own_bytes and cache.is_borrowed  # its own slabs went back
    assert torch.equal(lent[0, 1, :, :3], torch.ones(2, 3, 4)) and cache.capacity == 16
    taken = pool.num_bytes
    cache.own(6)
    assert not cache.is_borrowed and cache.capacity >= 6 and pool.num_bytes < taken
    assert torch.equal(cache.view(0)[0], torch.ones(3, 2, 4))
    cache.borrow(lent[:, 2], lent[:, 3])
    before = pool.num_bytes
    cache.release()
    assert pool.num_bytes == before  # the lent rows stay the lender's


def test_a_capture_binds_only_its_own_thread(sim_cuda):
    """As CUDA's thread-local capture mode (`device._TorchGraph`): the prefill thread copies to the
    device while the decode thread captures or replays."""
    import threading
    from cachesmith.testing.sim_cuda import SimCudaError

    copied = []
    with sim_cuda.capturing():
        with pytest.raises(SimCudaError, match="pageable"):
            torch.ones(4).to("cuda")
        other = threading.Thread(target=lambda: copied.append(torch.ones(4).to("cuda")))
        other.start()
        other.join()
    assert len(copied) == 1


def test_buckets():
    assert [graph_decode.batch_bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert graph_decode.batch_bucket(65) is None
    assert graph_decode.length_bucket(10, 4096) == graph_decode.MIN_LENGTH_BUCKET
    assert graph_decode.length_bucket(65, 4096) == 128
    assert graph_decode.length_bucket(3000, 2048) == 2048
