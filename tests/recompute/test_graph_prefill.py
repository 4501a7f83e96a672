"""Recompute runs replayed from captured CUDA graphs (`recompute/graph_prefill.py`), on the simulated
CUDA device and, where torch sees one, a GPU (`make test-cuda`).

The sim's capture records the run and runs nothing, and a replay re-runs the recorded ops on the
recorded tensors under capture rules (a host sync or a copy from pageable memory raises): so outputs
equal to the CPU's eager run show that the run keeps every input and output in its static buffers.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from cachesmith.model import Decoder
from cachesmith.model import device as accel
from cachesmith.recompute import BatchRunner, RecomputeRequest, cacheblend, epic, full_reuse
from cachesmith.recompute.config import RecomputeConfig, Signal, fused_family, fusionrag, last_layer, prophetkv
from cachesmith.recompute.graph_buffers import bucket_bytes, slab_bytes, work_bytes
from cachesmith.recompute.hooks import RunnerHooks
from cachesmith.testing.sim_backend import CAPTURE_SYNC
from cachesmith.testing.sim_cuda import SimCuda, active
from tests.recompute.helpers import make_request, max_diff

PLANS = {"full_reuse": full_reuse(), "epic@15%": epic(0.15), "epic@100%": epic(1.0),
         "cacheblend@15%": cacheblend(0.15),
         "kv_dev(2,1,30%) k": RecomputeConfig(Signal.KV_DEV, 2, 1, 0.3, "k"),
         "kv_dev(0,0,20%) kv": RecomputeConfig(Signal.KV_DEV, 0, 0, 0.2, "kv"),
         "position(1,0,30%)": RecomputeConfig(Signal.POSITION, 1, 0, 0.3),
         "prophetkv@15%": prophetkv(0.15, 4), "fusionrag@30%": fusionrag(0.3, 4),
         "last_layer@15%": last_layer(0.15, 4), "fused@30%": fused_family(0.3, 4),
         "qci(1,2,20%)": RecomputeConfig(Signal.QCI, 1, 2, 0.2)}
SHAPES = [dict(chunk_lens=(9, 12, 7), prefix_len=5, suffix_len=6, coverage=None),
          dict(chunk_lens=(30, 4), prefix_len=0, suffix_len=3, coverage=0.4),
          dict(chunk_lens=(17,), prefix_len=2, suffix_len=11, coverage=None)]


def save_llama(path, num_layers: int = 4, hidden: int = 64, max_positions: int = 2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=num_layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                 tie_word_embeddings=False)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("graph-prefill-llama"))


def batch(model: Decoder, shapes=SHAPES, seed: int = 0) -> list[RecomputeRequest]:
    return [make_request(model, seed + i, **shape)[0] for i, shape in enumerate(shapes)]


def assert_same_outputs(got, want, num_layers: int) -> None:
    """Logits, selection, scores, entropy and every layer's cache rows of two runs of one batch."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert max_diff(g.logits.cpu(), w.logits) < 1e-4
        assert torch.equal(g.selected.cpu(), w.selected.cpu())
        assert (g.num_context, g.num_suffix) == (w.num_context, w.num_suffix)
        assert (g.scores is None) == (w.scores is None)
        if w.scores is not None:
            assert max_diff(g.scores.cpu(), w.scores) < 1e-4
        assert (g.entropy is None) == (w.entropy is None)
        if w.entropy is not None:
            assert abs(g.qci_entropy - w.qci_entropy) < 1e-5
        assert g.cache.num_tokens == w.cache.num_tokens
        for layer in range(num_layers):
            for a, b in zip(g.cache.view(layer), w.cache.view(layer), strict=True):
                assert max_diff(a.cpu(), b) < 1e-4, layer


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("kind", [pytest.param("sim_cuda", marks=pytest.mark.sim_cuda)]
                         + ([pytest.param("cuda", marks=pytest.mark.cuda)] if accel.is_cuda_available() else []))
def test_replayed_runs_equal_the_cpus_eager_runs(llama_dir, name, kind):
    """float32, a batch of three requests of different sizes (prefix or none, own coverage or the
    plan's), then a batch of one in the same bucket: every output the eager CPU run gives."""
    plan = PLANS[name]
    cpu = Decoder(llama_dir, "cpu", torch.float32)
    want = BatchRunner(cpu).run(batch(cpu), plan)
    want_one = BatchRunner(cpu).run(batch(cpu, SHAPES[1:2], seed=7), plan)
    sim = SimCuda() if kind == "sim_cuda" else None
    with sim or nullcontext():
        model = Decoder(llama_dir, "cuda", torch.float32)
        runner = BatchRunner(model)
        got = runner.run(batch(model), plan)
        got_one = runner.run(batch(model, SHAPES[1:2], seed=7), plan)
        assert runner.graphs.num_replays == 2
        assert runner.graphs.num_captures == 2  # 3 requests pad to a bucket of 4, one to a bucket of 1
        assert_same_outputs(got, want, model.num_layers)
        assert_same_outputs(got_one, want_one, model.num_layers)


@pytest.mark.sim_cuda
@pytest.mark.parametrize("name", ["full_reuse", "cacheblend@15%", "fused@30%"])
def test_a_replay_neither_syncs_nor_copies_and_a_run_copies_in_once(llama_dir, sim_cuda, replay_counts, name):
    """The first run captures (one device sync, torch's graph context's); every run after replays:
    nothing synced or copied inside the replay, one host copy of the inputs per run, and for KV
    deviation or the query's attention one copy back of the selection (as the eager ranking reads
    its scores back)."""
    replays = replay_counts
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner, plan = BatchRunner(model), PLANS[name]
    requests, more = batch(model), batch(model, seed=3)
    with sim_cuda.count() as first:
        runner.run(requests, plan)
    with sim_cuda.count() as second:
        runner.run(more, plan)
    assert first.captures == 1 and first.sync_sites == [CAPTURE_SYNC]
    assert (second.captures, second.syncs, second.h2d, second.findings) == (0, 0, 1, [])
    assert second.d2h == (0 if name == "full_reuse" else 1)
    assert len(replays) == 2
    for c in replays:
        assert (c.syncs, c.h2d, c.d2h, c.findings, c.attention["math"]) == (0, 0, 0, [], 0)


@pytest.mark.sim_cuda
@pytest.mark.parametrize("name, most", [("full_reuse", 40), ("cacheblend@15%", 60)])
def test_host_calls_per_request_are_flat_in_layers(tmp_path, sim_cuda, name, most):
    """A request of 5 chunks: the torch calls the host makes in a replayed run are the same at 4
    and at 32 layers, and within the budget (the eager loop makes 50-70 per layer)."""
    calls = {}
    for num_layers in (4, 32):
        model = Decoder(save_llama(tmp_path / f"l{num_layers}", num_layers, hidden=32), "cuda", torch.float32)
        runner = BatchRunner(model)
        shape = dict(chunk_lens=(40,) * 5, prefix_len=0, suffix_len=8, coverage=None)
        runner.run(batch(model, [shape]), PLANS[name])  # captures
        requests = batch(model, [shape], seed=5)
        with sim_cuda.count() as c:
            runner.run(requests, PLANS[name])
        assert c.replays == 1
        calls[num_layers] = c.ops
    assert calls[4] == calls[32] <= most, calls


@pytest.mark.sim_cuda
@pytest.mark.parametrize("name", ["full_reuse", "cacheblend@15%", "kv_dev(2,1,30%) k", "fused@30%"])
def test_a_buckets_counted_bytes_hold_its_slabs_and_its_runs_working_set(llama_dir, sim_cuda, name):
    """What a bucket counts against the graph budget: its slabs, and at least the most its run holds
    at once beside them (run eagerly over the bucket's buffers, as the allocator sees it; the sim
    keeps every tensor a capture made, for its replays, so the capture's own count is no measure)."""
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner, plan, memory = BatchRunner(model), PLANS[name], sim_cuda.memory
    runner.run(batch(model), plan)
    (key, bucket), = runner.graphs._buckets.items()
    assert bucket.num_bytes == bucket_bytes(model, key) == slab_bytes(model, key) + work_bytes(model, key)
    before = memory.peak_bytes = memory.live_bytes
    bucket.step()
    held = memory.peak_bytes - before
    assert 0 < held <= work_bytes(model, key) <= 3 * held, (held, work_bytes(model, key))


@pytest.mark.sim_cuda
def test_buckets_stay_in_the_graph_budget_and_a_batch_that_does_not_fit_runs_eager(llama_dir, sim_cuda):
    """Buckets beyond the budget are freed oldest first; a bucket larger than the whole budget is
    never captured, and its batch runs eager with the same outputs."""
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner, plan = BatchRunner(model), cacheblend(0.15)
    runner.run(batch(model, SHAPES[:1]), plan)
    (bucket,) = runner.graphs._buckets.values()
    model.max_graph_bytes = int(1.5 * bucket.num_bytes)
    runner.run(batch(model, SHAPES[1:2]), epic(0.5))  # another family, another bucket: the first is freed
    assert runner.graphs.num_captures == 2 and len(runner.graphs._buckets) == 1
    assert runner.graphs.num_bytes <= model.max_graph_bytes
    model.max_graph_bytes = 1024
    cpu = Decoder(llama_dir, "cpu", torch.float32)
    got = runner.run(batch(model), plan)
    assert runner.graphs.num_replays == 2 and runner.graphs.num_captures == 2  # eager
    assert_same_outputs(got, BatchRunner(cpu).run(batch(cpu), plan), model.num_layers)


@pytest.mark.sim_cuda
def test_what_is_not_graphed_runs_eager(llama_dir, sim_cuda):
    """Plans decided after layer 0, runs with per-layer hooks, staged caches and a model whose
    graphs are turned off (`serve --no-cuda-graphs`) replay nothing."""
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner = BatchRunner(model)
    runner.run(batch(model), cacheblend(0.15), replan=lambda entropies: (last_layer(0.15, model.num_layers), None))
    runner.run(batch(model), full_reuse(), RunnerHooks())
    staged = batch(model, SHAPES[:1])
    staged[0].cache = model.new_cache(40)
    assert not runner.graphs.takes(staged, full_reuse())
    model.is_prefill_graphed = False
    runner.run(batch(model), full_reuse())
    assert (runner.graphs.num_captures, runner.graphs.num_replays) == (0, 0)
    model.is_prefill_graphed = True
    runner.run(batch(model), full_reuse())
    assert (runner.graphs.num_captures, runner.graphs.num_replays) == (1, 1)
    assert active() is sim_cuda


@pytest.mark.sim_cuda
def test_bad_input_gets_the_eager_paths_errors(llama_dir, sim_cuda):
    from cachesmith.errors import InputError

    model = Decoder(llama_dir, "cuda", torch.float32)
    requests = batch(model, SHAPES[:1])
    requests[0].suffix_ids = []
    with pytest.raises(InputError, match=r"requests\[0\].suffix_ids is empty"):
        BatchRunner(model).run(requests, full_reuse())


@pytest.mark.sim_cuda
def test_a_run_whose_device_work_outlasts_its_launches_runs_eager(llama_dir, sim_cuda):
    """Above `max_row_params` (rows per layer x a layer's parameters) a run goes eager: its
    device work would hide the launches a graph saves, and a graph would only add its padding.
    Full reuse computes only the question's rows and stays graphed where CacheBlend's full
    layer 0 and selected rows go over."""
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner = BatchRunner(model)
    requests = batch(model)
    params = model.config.num_layer_parameters
    questions = sum(len(r.suffix_ids) for r in requests)  # full reuse: the question rows, every layer
    runner.graphs.max_row_params = questions * params
    assert runner.graphs.is_launch_bound(requests, full_reuse())
    assert not runner.graphs.is_launch_bound(requests, cacheblend(0.15))
    runner.graphs.max_row_params = questions * params - 1
    assert not runner.graphs.is_launch_bound(requests, full_reuse())
    cpu = Decoder(llama_dir, "cpu", torch.float32)
    got = runner.run(requests, cacheblend(0.15))
    assert (runner.graphs.num_captures, runner.graphs.num_replays) == (0, 0)
    assert_same_outputs(got, BatchRunner(cpu).run(batch(cpu), cacheblend(0.15)), model.num_layers)


@pytest.mark.sim_cuda
def test_a_runs_caches_are_its_bucket_rows_until_the_next_replay_moves_them_out(llama_dir, sim_cuda, monkeypatch):
    """A replayed run's caches are lent its bucket's rows (no copy out); the bucket's next replay
    first moves the ones still held into slabs of their own, rows intact, with the room their
    requests asked for; a released or dropped one costs nothing; a lent cache takes a decoder's
    writes outside inference mode."""
    from cachesmith.model import KVCache

    moved = []
    own = KVCache.own
    monkeypatch.setattr(KVCache, "own", lambda cache, capacity=None: moved.append(cache) or own(cache, capacity))
    model = Decoder(llama_dir, "cuda", torch.float32)
    runner, plan = BatchRunner(model), cacheblend(0.15)
    requests = batch(model)
    for r in requests:
        r.extra_capacity = 40  # past the bucket's rows: the move makes room for it
    first = runner.run(requests, plan)
    assert all(o.cache.is_borrowed and not o.cache.is_head_major for o in first)
    pooled = model.kv_pool.num_bytes
    first[2].cache.release()
    assert model.kv_pool.num_bytes == pooled  # the bucket's rows are not the pool's to hand out
    runner.run(batch(model, seed=3), plan)  # dropped unreleased: nothing to move at the next replay
    assert moved == [first[0].cache, first[1].cache]
    second = runner.run(batch(model, seed=5), plan)
    assert (runner.graphs.num_captures, runner.graphs.num_replays) == (1, 3)
    assert len(moved) == 2 and not first[0].cache.is_borrowed and not first[1].cache.is_borrowed
    cpu = Decoder(llama_dir, "cpu", torch.float32)
    want = BatchRunner(cpu).run(batch(cpu), plan)
    assert_same_outputs(first[:2], want[:2], model.num_layers)
    assert first[0].cache.capacity >= first[0].cache.num_tokens + 40
    cache = second[0].cache
    assert cache.is_borrowed
    row = torch.ones(1, model.config.num_kv_heads, model.config.head_dim, device="cuda")
    cache.write(0, cache.num_tokens, row, row)  # outside inference mode, into the bucket's rows
    assert torch.equal(cache.keys[0][cache.num_tokens].cpu(), row[0].cpu())


def test_the_launch_bound_line_is_about_550_question_rows_a_layer_of_the_8b_shape():
    """What docs/serving.md and ADR 0053 say of `MAX_ROW_PARAMS`: full reuse of the 8B shape
    (every layer runs only the question's rows) graphs up to about 550 of them, and not beyond."""
    from types import SimpleNamespace

    from cachesmith.model.config import ModelConfig
    from cachesmith.recompute.graph_prefill import GraphPrefill

    cfg = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 8192, False, False, False)
    graphs = GraphPrefill(SimpleNamespace(num_layers=32, config=cfg))

    def asks(num_question: int):
        return [SimpleNamespace(chunks=[SimpleNamespace(num_tokens=2048)], prefix=None, suffix_ids=[1] * num_question)]
    assert graphs.is_launch_bound(asks(540), full_reuse()) and not graphs.is_launch_bound(asks(560), full_reuse())
