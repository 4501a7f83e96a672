"""The GPU check's path checks (benchmarks/common/gpu_paths.py, issue 77): graph decode's tokens against
eager decode's (on the CPU both are eager; on the simulated device the graph path replays), the
near-tie rule in half precision, and the recorder of attention calls whose kernels the check asks
torch about."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import gpu_paths
from benchmarks.common.gpu_paths import SdpaCall, SdpaRecorder, kernel_row, tokens_row
from cachesmith.model import Decoder

CPU = torch.device("cpu")


def qkv(length: int, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    return (torch.randn(1, heads, length, dim, generator=g), torch.randn(1, kv_heads, length, dim, generator=g),
            torch.randn(1, kv_heads, length, dim, generator=g))


def test_the_recorder_notes_each_call_by_kind_and_changes_none():
    recorder = SdpaRecorder()
    q, k, v = qkv(5)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with recorder.during("prefill"):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(*qkv(7), is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # no phase on: not noted
    assert torch.equal(got, expected)
    kinds = recorder.kinds()
    assert list(kinds) == ["prefill q[1,4,*,8] kv[1,2,*,8] causal gqa", "prefill q[1,4,*,8] kv[1,4,*,8] mask"]
    assert [sorted(c.k.shape[-2] for c in calls) for calls in kinds.values()] == [[5, 7], [5]]


def test_a_call_passed_positionally_reads_as_one_passed_by_name():
    q, k, v = qkv(3)
    mask = torch.ones(3, 3, dtype=torch.bool)
    assert SdpaCall.of((q, k, v, mask, 0.0, True), {}) == SdpaCall.of((q, k, v), {"attn_mask": mask, "is_causal": True})


def test_a_kernel_row_on_the_cpu_names_no_kernel():
    recorder = SdpaRecorder()
    with recorder.during("decode eager"):
        for length in (4, 9):
            F.scaled_dot_product_attention(*qkv(length, kv_heads=4))
    (calls,) = recorder.kinds().values()
    row = kernel_row(calls, CPU)
    assert (row["picked"], row["passed"], row["calls"], row["key_lengths"]) == (None, None, 2, [4, 9])


def test_a_kernel_row_fails_where_any_length_falls_to_math(monkeypatch, sim_cuda):
    """Fresh tensors of each signature go to `device.sdpa_kernels`; one math answer fails the kind."""
    answers = iter([{"flash": False, "efficient": True, "cudnn": False, "picked": "efficient", "reasons": []},
                    {"flash": False, "efficient": False, "cudnn": False, "picked": "math", "reasons": ["too long"]}])
    asked = []

    def sdpa_kernels(q, k, v, mask, is_causal, enable_gqa):
        asked.append((q.device.type, tuple(k.shape), mask is None))
        return next(answers)
    monkeypatch.setattr(gpu_paths.accel, "sdpa_kernels", sdpa_kernels)
    calls = {SdpaCall.of(qkv(n), {}): 1 for n in (4, 9)}
    row = kernel_row(calls, torch.device("cuda"))
    assert asked == [("cuda", (1, 2, 4, 8), True), ("cuda", (1, 2, 9, 8), True)]
    assert row["picked"] == ["efficient", "math"] and row["reasons"] == ["too long"] and row["passed"] is False


def test_both_paths_give_one_set_of_tokens_on_the_cpu(tiny_llama_dir):
    recorder = SdpaRecorder()
    row = tokens_row(Decoder(tiny_llama_dir[0], "cpu", "float32"), 12, 2, 5, recorder)
    assert row["tokens_equal"] and row["passed"] and row["graph_replays"] == 0  # no graphs on the CPU
    assert set(recorder.calls) == {"prefill", "decode eager", "decode graph"}


@pytest.mark.sim_cuda
def test_the_graph_path_replays_and_matches_on_the_simulated_device(tiny_llama_dir, sim_cuda):
    row = tokens_row(Decoder(tiny_llama_dir[0], "cuda", "float32"), 12, 2, 5, SdpaRecorder())
    assert row["tokens_equal"] and row["passed"] and row["graph_replays"] == 5 - 1  # a replay a step


@pytest.mark.parametrize(("dtype", "gap", "passed"), [("bfloat16", 0.05, True), ("bfloat16", 0.5, False),
                                                      ("float32", 0.0, False)])
def test_a_differing_step_passes_only_as_a_near_tie_in_half_precision(tiny_llama_dir, monkeypatch, dtype, gap,
                                                                      passed):
    runs = iter([([[1, 2, 3], [4, 5, 6]], 0), ([[1, 2, 3], [4, 7, 8]], 2)])  # eager, then graph
    monkeypatch.setattr(gpu_paths, "decode_tokens", lambda *a, **k: next(runs))
    monkeypatch.setattr(gpu_paths, "tie_gap", lambda model, prompt, eager, graph, step: gap)
    row = tokens_row(Decoder(tiny_llama_dir[0], "cpu", dtype), 8, 2, 3, SdpaRecorder())
    assert not row["tokens_equal"] and row["first_difference"] == {"1": 1} and row["passed"] is passed


def test_the_tie_gap_is_read_where_the_paths_parted(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0], "cpu", "float32")
    prompt = torch.arange(6)
    logits, cache = model.prefill(torch.cat([prompt, torch.tensor([3])]))
    cache.release()
    a, b = logits.topk(2).indices.tolist()
    gap = gpu_paths.tie_gap(model, prompt, [3, a], [3, b], 1)
    assert gap == pytest.approx(((logits[a] - logits[b]) / logits.std()).item(), rel=1e-5)
    assert gpu_paths.tie_gap(model, prompt, [3, a], [3], 1) == float("inf")
