"""Batched decode steps, prepacked small-row linears and continuous decoding, on tiny random models
(float32), against the one-sequence reference `Decoder.decode_step`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachesmith.errors import InputError
from cachesmith.model import Decoder, Decoding, greedy_decode
from cachesmith.model import row_attention
from cachesmith.model.decode import decode_step
from cachesmith.model import linear as linear_mod
from cachesmith.model.linear import MAX_PACKED_ROWS, Linear, tune_one_row


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_linear_agrees_with_f_linear_at_every_row_count(dtype, tol):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    lin = Linear(weight, bias)
    # where torch has oneDNN (x86 wheels), the small-row path runs (and is what is compared below)
    assert (lin.packed is not None) == (torch.backends.mkldnn.is_available()
                                        and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    for rows in (1, 2, 7, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 100):
        x = torch.randn(rows, 40, generator=g).to(dtype)
        assert (lin(x).float() - F.linear(x, weight, bias).float()).abs().max().item() <= tol
    strided = torch.randn(5, 80, generator=g).to(dtype)[:, ::2]  # a non-contiguous input
    assert (lin(strided).float() - F.linear(strided, weight, bias).float()).abs().max().item() <= tol


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN packed kernel in this torch build")
@pytest.mark.parametrize("packed_s, is_chosen", [(0.5, True), (0.95, False), (2.0, False)])
def test_one_row_goes_packed_only_when_measured_clearly_faster(monkeypatch, packed_s, is_chosen):
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(64, 24, generator=g), torch.randn(64, generator=g)
    lins = [Linear(weight, bias), Linear(weight.clone())]
    calls = []

    def fake_pass(linears, rows, is_packed):  # plain 1.0 s, packed `packed_s`: the decision, not the clock
        calls.append(is_packed)
        assert list(linears) == lins and set(rows) == {24}
        return packed_s if is_packed else 1.0
    monkeypatch.setattr(linear_mod, "_one_pass_s", fake_pass)
    assert tune_one_row(lins, repeats=2) is is_chosen
    assert sorted(calls) == [False, False, True, True]
    assert all(lin.is_one_row_packed is is_chosen for lin in lins)
    x = torch.randn(1, 24, generator=g)  # either kernel: the same map
    assert (lins[0](x) - F.linear(x, weight, bias)).abs().max().item() <= 1e-5
    calls.clear()  # packed ones are not timed again; refused ones are
    assert tune_one_row(lins) is is_chosen and (calls == []) is is_chosen


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                    reason="no bfloat16 packed kernel on this CPU")
def test_bfloat16_rows_are_packed_without_timing(monkeypatch):
    monkeypatch.setattr(linear_mod, "_one_pass_s", lambda *a: pytest.fail("timed an already packed linear"))
    lins = [Linear(torch.randn(64, 24).to(torch.bfloat16))]
    assert lins[0].is_one_row_packed and tune_one_row(lins) is True


def test_tiny_models_skip_the_one_row_timing(tiny_llama_dir):
    assert Decoder(tiny_llama_dir[0]).is_one_row_packed is False  # weights fit in cache: nothing to learn


@pytest.mark.parametrize("is_head_major", [False, True])
def test_batched_step_equals_each_sequence_alone(tiny_model_dir, is_head_major):
    path, _ = tiny_model_dir
    model = Decoder(path)
    lengths = (5, 17, 30)  # different positions in one step
    alone, together = [], []  # the reference steps over token-major (staging layout) caches
    for n, seed in zip(lengths, range(3)):
        _, c1 = model.prefill(_ids(n, seed), extra_capacity=4)
        _, c2 = model.prefill(_ids(n, seed), extra_capacity=4)
        if is_head_major:
            c2.to_head_major()
        alone.append(c1)
        together.append(c2)
    tokens = [7, 11, 13]
    for _ in range(3):  # several steps: each cache grows by one row per step
        ref = torch.stack([model.decode_step(t, c) for t, c in zip(tokens, alone)])
        out = decode_step(model, tokens, together)
        assert (out - ref).abs().max().item() < 1e-4
        assert [c.num_tokens for c in together] == [c.num_tokens for c in alone]
        tokens = ref.argmax(-1).tolist()


def test_decode_step_refuses_mismatched_inputs(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    _, cache = model.prefill(_ids(4, 0))
    with pytest.raises(InputError, match="2 token ids for 1 caches"):
        decode_step(model, [1, 2], [cache])


def test_sequences_joining_and_leaving_decode_as_alone(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    expected = []
    for seed, budget in ((0, 12), (1, 4), (2, 9)):
        logits, cache = model.prefill(_ids(8 + seed, seed), extra_capacity=16)
        expected.append(greedy_decode(model, logits, cache, budget, eos_token_ids=()))
    decoding = Decoding(model)
    gens, seen = [], []
    for step, (seed, budget) in enumerate(((0, 12), (1, 4), (2, 9))):
        logits, cache = model.prefill(_ids(8 + seed, seed), extra_capacity=16)
        gens.append(decoding.start(logits, cache, budget, eos_token_ids=()))
        seen.append(len(decoding.active))
        decoding.step()  # the next sequence joins after this step
    decoding.run()
    assert [g.token_ids for g in gens] == expected
    assert seen == [1, 2, 3]  # every sequence was stepped beside the others
    # budgets of 12 and 9 decode over head-major caches; 4 leaves 3 steps, too few to move for
    assert [g.cache.is_head_major for g in gens] == [True, False, True]
    assert all(g.is_done and not decoding.active for g in gens)


def test_generation_stops_at_the_models_last_position(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    limit = model.config.max_positions
    logits, cache = model.prefill(_ids(limit - 3, 0), extra_capacity=8)
    ids = greedy_decode(model, logits, cache, 50, eos_token_ids=())
    # prompt and answer fill the positions; the last token is never fed back, so takes no row
    assert len(ids) == 3 and cache.num_tokens == limit - 1


@pytest.mark.skipif(row_attention._FLASH_CPU is None, reason="torch build without the CPU flash kernel")
@pytest.mark.parametrize("num_keys, splits", [(1024, 2), (1027, 2), (1031, 3), (2053, 4), (600, 5)])
def test_split_key_attention_equals_one_call(num_keys, splits):
    g = torch.Generator().manual_seed(num_keys)
    num_heads, num_kv_heads, head_dim = 6, 3, 16
    q = torch.randn(num_heads, head_dim, generator=g)
    slab = torch.randn(2, num_keys + 7, num_kv_heads, head_dim, generator=g)  # a cache with spare rows
    keys, values = slab[0, :num_keys], slab[1, :num_keys]
    grouped = q.view(1, num_kv_heads, 2, head_dim)
    ref = F.scaled_dot_product_attention(grouped, keys.transpose(0, 1)[None], values.transpose(0, 1)[None]).reshape(-1)
    mask = row_attention.overlap_mask(num_keys, splits, keys.dtype, keys.device)
    assert (mask is None) == (num_keys % splits == 0)
    out = row_attention._attend_split(grouped, keys, values, row_attention.KeySplit(splits, mask))
    # where num_keys % splits > 0 the ranges overlap: equality shows the overlap counted once
    assert (out - ref).abs().max().item() < 1e-5


def test_key_splits_follow_threads_and_heads(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert row_attention.num_key_splits(4096, 3, cpu) == 2  # 3 heads on 2 threads: halve the keys
    assert row_attention.num_key_splits(4095, 3, cpu) == 1  # too few keys for two ranges
    assert row_attention.num_key_splits(4096, 2, cpu) == 1  # 2 heads already share 2 threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert row_attention.num_key_splits(4096, 3, cpu) == 2  # 16 / gcd(16, 3) = 16, capped at 4096 / 2048
    assert row_attention.num_key_splits(32768, 3, cpu) == 16
    assert row_attention.num_key_splits(4096, 3, torch.device("meta")) == 1


@pytest.mark.skipif(row_attention._FLASH_CPU is None, reason="torch build without the CPU flash kernel")
def test_batched_step_with_split_keys_equals_each_sequence_alone(tiny_llama_dir, monkeypatch):
    model = Decoder(tiny_llama_dir[0])
    # tiny contexts: let 4+ keys split, and 3 "threads" over 2 KV heads make 3 ranges per row
    monkeypatch.setattr(row_attention, "MIN_SPLIT_KEYS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert row_attention.key_split(13, model.config.num_kv_heads, model.dtype, model.device).num_ranges == 3
    lengths = (12, 13, 29)  # overlaps of 0, 1 and 2 keys (with the new row: 13, 14, 30 keys)
    alone = [model.prefill(_ids(n, seed), extra_capacity=4)[1] for n, seed in zip(lengths, range(3))]
    together = [model.prefill(_ids(n, seed), extra_capacity=4)[1] for n, seed in zip(lengths, range(3))]
    together[1].to_head_major()  # the ranges' strides in either layout
    tokens = [7, 11, 13]
    for _ in range(2):
        ref = torch.stack([model.decode_step(t, c) for t, c in zip(tokens, alone)])
        out = decode_step(model, tokens, together)
        assert (out - ref).abs().max().item() < 1e-4
        tokens = ref.argmax(-1).tolist()
