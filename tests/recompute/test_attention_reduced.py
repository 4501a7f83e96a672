"""Scattered attention in reduced precision: the default block plan and its exactness."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model.layers import DecoderLayer, RMSNorm, causal_by_position_mask
from cachesmith.recompute.attention import ROWS_PER_BLOCK_REDUCED, ScatteredAttention, default_num_blocks

CPU = torch.device("cpu")


class _Attend:  # `attend` reads no weights
    attend = DecoderLayer.attend


@pytest.mark.parametrize(("num_scattered", "expected"), [(0, 1), (1, 1), (256, 1), (257, 2), (700, 3)])
def test_reduced_precision_blocks_follow_the_row_count(num_scattered, expected):
    assert ROWS_PER_BLOCK_REDUCED == 256
    assert default_num_blocks(CPU, torch.bfloat16, num_scattered) == expected
    assert default_num_blocks(CPU, torch.float32, num_scattered) == 4
    assert default_num_blocks(torch.device("cuda"), torch.bfloat16, num_scattered) == 1


def test_bfloat16_blocks_match_one_masked_call():
    g = torch.Generator().manual_seed(3)
    num_keys, num_suffix = 1400, 20
    scattered = torch.sort(torch.randperm(num_keys - num_suffix, generator=g)[:600]).values
    positions = torch.cat([scattered, torch.arange(num_keys - num_suffix, num_keys)])
    q = torch.randn(positions.numel(), 4, 16, generator=g)
    k, v = torch.randn(num_keys, 2, 16, generator=g), torch.randn(num_keys, 2, 16, generator=g)
    ref = DecoderLayer.attend(None, q, k, v, mask=causal_by_position_mask(positions, torch.arange(num_keys)))
    plan = ScatteredAttention(positions, CPU, torch.bfloat16, num_suffix)
    assert len(plan.blocks) == 3 + 1  # 600 scattered rows in 3 blocks, the suffix on its own
    out = plan(_Attend(), q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    assert (out - ref).abs().max().item() < 0.03  # bfloat16 inputs: rounding only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_rms_norm_matches_the_upcast_formula(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm((1 + 0.1 * torch.randn(64, generator=g)).to(dtype), 1e-6)
    x = (torch.randn(50, 3, 64, generator=g) * 7).to(dtype)
    upcast = norm.weight * torch.nn.functional.rms_norm(x.float(), (64,), eps=1e-6).to(dtype)
    assert torch.equal(norm(x), upcast)
