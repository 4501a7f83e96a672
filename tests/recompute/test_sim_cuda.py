"""The layer loop on the simulated CUDA device: which attention kernel CUDA would run, and what a
run copies between host and device; and on each device of the `device` fixture (a GPU's too, where
torch sees one: `make test-cuda`), float32's identities and the CPU's logits.

A GPU runs the Patch and suffix rows' masked attention in its memory-efficient kernel only when the
KV heads come expanded (no `enable_gqa`); the math kernel builds the whole float32 score matrix.
Masks are built on the device, so a run copies only a fixed few small host tensors to it, however
many layers and chunks: `H2D_PER_REQUEST`.
"""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import Decoder, prefill_chunk
from cachesmith.recompute import BatchRunner, RecomputeRequest, cacheblend, epic, full_reuse
from cachesmith.recompute.config import RecomputeConfig, Signal, fused_family, fusionrag
from cachesmith.testing.sim_cuda import active
from tests.recompute.helpers import make_request, max_diff

# per request and run: the question's ids, the stored chunks' ids (`build_sequence`), and the Patch
# rows' positions (`BatchRunner._patch_rows`), from which the device builds indices and masks
H2D_PER_REQUEST = 3
PLANS = {"full_reuse": lambda n: full_reuse(), "cacheblend@15%": lambda n: cacheblend(0.15),
         "epic@15%": lambda n: epic(0.15), "qci@15%": lambda n: RecomputeConfig(Signal.QCI, 1, 1, 0.15),
         "fusionrag@15%": lambda n: fusionrag(0.15, n), "fused@20%": lambda n: fused_family(0.2, n)}
RANKED = {"cacheblend@15%", "qci@15%", "fusionrag@15%", "fused@20%"}  # their ranking is read back


def _save_llama(path, num_layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 tie_word_embeddings=False)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """num_layers -> a tiny GQA llama (4 query heads over 2 KV heads)."""
    return {n: _save_llama(tmp_path_factory.mktemp(f"sim-llama-{n}"), n) for n in (3, 6)}


def _ids(seed: int, num_chunks: int, chunk_len: int = 40) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randint(3, 128, (chunk_len,), generator=g).tolist() for _ in range(num_chunks)]
    return chunks, torch.randint(3, 128, (8,), generator=g).tolist()


def _request(model: Decoder, chunks: list[list[int]], question: list[int]) -> RecomputeRequest:
    return RecomputeRequest([prefill_chunk(model, c) for c in chunks], question)


def _first_logits(path, device: str, dtype: torch.dtype, plan_name: str, sim=None):
    """Last-position logits of one run of the plan (the second, when counted on `sim`), its counts."""
    model = Decoder(path, device, dtype)
    request = _request(model, *_ids(1, 3))
    runner, plan = BatchRunner(model), PLANS[plan_name](model.num_layers)
    if sim is None:
        return runner.run([request], plan)[0].logits, None
    runner.run([request], plan)  # first use builds lazy tables (RoPE): not the steady state
    with sim.count() as counts:
        logits = runner.run([request], plan)[0].logits
    return logits.cpu(), counts


@pytest.mark.sim_cuda
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_patch_rows_never_run_the_math_kernel_and_give_the_cpu_tokens(model_dirs, sim_cuda, plan_name):
    """bfloat16, what a GPU serves: every attention call is one CUDA runs fast (on an H100, cuDNN,
    which takes the masked Patch rows with GQA and no copy of K/V per query head), and the first
    token is the CPU's."""
    path = model_dirs[3]
    cpu_logits, _ = _first_logits(path, "cpu", torch.bfloat16, plan_name)
    logits, counts = _first_logits(path, "cuda", torch.bfloat16, plan_name, sim_cuda)
    assert counts.attention["math"] == 0, counts.attention
    assert counts.attention["cudnn"] > 0, counts.attention
    assert int(logits.argmax()) == int(cpu_logits.argmax())


@pytest.mark.parametrize("plan_name", ["full_reuse", "cacheblend@15%", "qci@15%"])
def test_float32_logits_equal_the_cpus(model_dirs, device, plan_name):
    """float32: the expanded-heads call on each device computes what the CPU's kernels do (the CPU
    splits the scattered rows' attention differently: equal up to rounding); on the simulated
    device, no attention call is one only the math kernel runs."""
    path, sim = model_dirs[3], active()
    cpu_logits, _ = _first_logits(path, "cpu", torch.float32, plan_name)
    logits, counts = _first_logits(path, device, torch.float32, plan_name, sim)
    if sim is not None:
        assert counts.attention["math"] == 0, counts.attention
    assert max_diff(logits.cpu(), cpu_logits) < 1e-4


@pytest.mark.parametrize("plan", [RecomputeConfig(Signal.KV_DEV, 1, 0, 1.0), RecomputeConfig(Signal.QCI, 1, 2, 1.0)],
                         ids=["kv_dev", "qci"])
def test_full_coverage_equals_full_prefill_on_each_device(model_dirs, device, plan):
    """Every context token recomputed is full prefill on the same device (logits and each layer's
    KV within 1e-4), and the CPU's full prefill too: the identity of test_identities.py, per device."""
    model, cpu_model = Decoder(model_dirs[3], device, torch.float32), Decoder(model_dirs[3], "cpu", torch.float32)
    request, flat = make_request(model, seed=4)
    ref_logits, ref_cache = model.prefill(flat)
    out = BatchRunner(model).run([request], plan)[0]
    assert out.logits.device == model.device and out.selected.numel() == out.num_context
    assert max_diff(out.logits, ref_logits) < 1e-4
    for layer in range(model.num_layers):
        for got, want in zip(out.cache.view(layer), ref_cache.view(layer), strict=True):
            assert max_diff(got, want) < 1e-4, layer
    assert max_diff(out.logits.cpu(), cpu_model.prefill(flat)[0]) < 1e-4


@pytest.mark.sim_cuda
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_a_run_copies_a_fixed_few_tensors_whatever_the_layers_and_chunks(model_dirs, sim_cuda, plan_name):
    """Per eager `BatchRunner.run`: `H2D_PER_REQUEST` host -> device copies per request, for 3 or 6
    layers and 2 or 8 chunks; no host sync; the rankings are the only reads back (a graphed run
    copies its inputs once: test_graph_prefill.py)."""
    for num_layers, path in model_dirs.items():
        model = Decoder(path, "cuda", torch.bfloat16)
        model.is_prefill_graphed = False
        runner, plan = BatchRunner(model), PLANS[plan_name](num_layers)
        for num_chunks in (2, 8):
            batch = [_request(model, *_ids(seed, num_chunks)) for seed in (1, 2)]
            runner.run(batch, plan)
            with sim_cuda.count() as counts:
                runner.run(batch, plan)
            where = (plan_name, num_layers, num_chunks, counts)
            assert counts.h2d == H2D_PER_REQUEST * len(batch), where
            assert counts.syncs == 0, where
            assert counts.d2h == (len(batch) if plan_name in RANKED else 0), where
            assert not counts.findings, where


@pytest.mark.sim_cuda
def test_recording_layer_times_adds_no_host_sync(model_dirs, sim_cuda):
    """The profile's layer times come from device timing events read after the run: timing a run
    must not add a sync per layer, or the costs it measures would include drained streams."""
    from cachesmith.recompute import LayerStatsRecorder

    model = Decoder(model_dirs[6], "cuda", torch.bfloat16)
    model.is_prefill_graphed = False  # the same eager loop, with and without the recorder
    request, runner, plan = _request(model, *_ids(2, 4)), BatchRunner(model), cacheblend(0.15)
    runner.run([request], plan)
    with sim_cuda.count() as plain:
        runner.run([request], plan)
    recorder = LayerStatsRecorder(model.device)
    with sim_cuda.count() as timed:
        runner.run([request], plan, recorder)
    assert timed.syncs == plain.syncs and timed.h2d == plain.h2d
    stats = recorder.stats
    assert [s.layer for s in stats] == list(range(6)) and all(s.seconds > 0 for s in stats)
    assert recorder.total_seconds() == pytest.approx(sum(s.seconds for s in stats))
