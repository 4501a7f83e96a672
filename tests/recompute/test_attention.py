"""Scattered-row attention and explicit probabilities against one plain masked computation."""
from __future__ import annotations

import math

import pytest
import torch

from cachesmith.model import Decoder
from cachesmith.model.layers import causal_by_position_mask
from cachesmith.recompute.attention import ScatteredAttention, attention_probs


@pytest.fixture(scope="module")
def layer(tiny_llama_dir):
    return Decoder(tiny_llama_dir[0]).layers[0]


def _inputs(num_keys=90, num_suffix=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    scattered = torch.sort(torch.randperm(num_keys - num_suffix, generator=g)[:23]).values
    positions = torch.cat([scattered, torch.arange(num_keys - num_suffix, num_keys)])
    q = torch.randn(positions.numel(), 4, 16, generator=g)
    k = torch.randn(num_keys, 2, 16, generator=g)
    v = torch.randn(num_keys, 2, 16, generator=g)
    return positions, q, k, v


@pytest.mark.parametrize("num_blocks", [1, 2, 4, 8, 40])
def test_blocks_equal_one_masked_call(layer, num_blocks):
    positions, q, k, v = _inputs()
    ref = layer.attend(q, k, v, mask=causal_by_position_mask(positions, torch.arange(k.shape[0])))
    plan = ScatteredAttention(positions, torch.device("cpu"), torch.float32, num_suffix=5,
                              num_blocks=num_blocks)
    assert (plan(layer, q, k, v) - ref).abs().max().item() < 1e-5
    assert len(plan.blocks) == (1 if num_blocks == 1 else min(num_blocks, 23) + 1)
    assert plan.blocks[0][2] <= positions[plan.blocks[0][1] - 1] + 1  # first block sees a key prefix only


def test_attention_probs_equal_direct_softmax():
    positions, q, k, _ = _inputs(seed=1)
    probs = attention_probs(q, k, positions, torch.arange(k.shape[0]))  # [H, n, Sk]
    keys = k.repeat_interleave(2, dim=1)  # 4 query heads over 2 KV heads
    logits = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(16)
    visible = causal_by_position_mask(positions, torch.arange(k.shape[0]))
    ref = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    assert (probs - ref).abs().max().item() < 1e-6
    assert torch.allclose(probs.sum(-1), torch.ones(4, positions.numel()))


@pytest.mark.parametrize("num_blocks", [1, 3, 16, 40])
def test_split_attention_equals_one_masked_call(layer, num_blocks):
    from cachesmith.recompute.split_attention import SplitAttention, is_available

    assert is_available(torch.device("cpu"), torch.float32)
    positions, q, k, v = _inputs(seed=2)
    ref = layer.attend(q, k, v, mask=causal_by_position_mask(positions, torch.arange(k.shape[0])))
    plan = SplitAttention(positions, num_suffix=5, num_heads=4, num_kv_heads=2, num_blocks=num_blocks)
    assert (plan(layer, q, k, v) - ref).abs().max().item() < 1e-5
    assert any(lo > 0 for _, _, lo, _, _ in plan.blocks)  # the merged (prefix + diagonal) path ran
