"""Attention of scattered query rows over a mixed (cached + fresh) KV, and explicit probabilities.

In: rotated queries at sorted true positions, the layer's full K/V buffer. Out: attention outputs,
or the softmax probabilities the QCI signal sums.

A single masked call over the full key length does twice the work of a causal pass for rows spread
over the sequence. `ScatteredAttention` splits the sorted query rows into blocks and gives each
block only the keys up to its last position, so the work moves toward the causal half: the key
tiles past a block's last row are never computed. The CPU flash kernel skips nothing under a mask,
so that slicing is the tile skipping; on CPU float32 `split_attention` goes further. On CUDA the
masks are built on the device, and `DecoderLayer.attend` gives a masked call expanded KV heads, so
the memory-efficient kernel runs it, not the math one.
"""
from __future__ import annotations

import math

import torch

from cachesmith.model.layers import DecoderLayer, causal_by_position_mask


# Reduced precision on CPU: at most this many scattered rows per block (ADR 0015, docs/adr/0015-scattered-attention.md). The
# kernel's cost per (row, key) is flat from about 128 rows per call up and climbs below (smaller
# query tiles), so blocks of 128-256 rows cut the masked keys without paying for small calls.
ROWS_PER_BLOCK_REDUCED = 256
MASK_ALIGNMENT = 8  # elements per mask row CUDA's memory-efficient attention takes without a padded copy


def default_num_blocks(device: torch.device, dtype: torch.dtype, num_scattered: int = 0) -> int:
    """Blocks per request for scattered attention, from measurements on the CPU flash kernel
    (ADR 0015): in float32 four blocks cut the work best; in bfloat16 / float16 one block
    per `ROWS_PER_BLOCK_REDUCED` scattered rows (1 for up to 256 rows); elsewhere (CUDA) one."""
    if device.type != "cpu":
        return 1
    if dtype == torch.float32:
        return 4
    return max(1, -(-num_scattered // ROWS_PER_BLOCK_REDUCED))


class ScatteredAttention:
    """Block plan for query rows at sorted `q_positions`; masks are built once, reused per layer.

    `q_positions` is a host tensor: its values size the blocks without a device sync. The masks are
    built on `device` from `device_positions` (the same positions there; copied once when absent),
    so a run copies a few positions to the device, never a [rows, keys] mask."""

    def __init__(self, q_positions: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 num_suffix: int, num_blocks: int | None = None,
                 device_positions: torch.Tensor | None = None) -> None:
        num_q = q_positions.numel()
        num_scattered = num_q - num_suffix
        num_blocks = default_num_blocks(device, dtype, num_scattered) if num_blocks is None else num_blocks
        groups = min(num_blocks, num_scattered)
        bounds = [num_scattered * g // groups for g in range(groups + 1)] if groups else [0]
        if num_blocks > 1 or not groups:
            bounds.append(num_q)  # the suffix is its own block: it sees every key
        else:
            bounds[-1] = num_q  # one call for everything
        positions = q_positions.to(device) if device_positions is None else device_positions  # [num_q]
        self.blocks: list[tuple[int, int, int, torch.Tensor]] = []
        host_positions = q_positions.tolist()  # a host tensor: its values are read without a device sync
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b <= a:
                continue
            num_keys = host_positions[b - 1] + 1
            self.blocks.append((a, b, num_keys, _additive_mask(positions[a:b], num_keys, dtype)))

    def __call__(self, layer: DecoderLayer, q: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
        """q [num_q, H, D]; keys/values [S, Hkv, D] -> [num_q, H * D]."""
        if len(self.blocks) == 1 and self.blocks[0][2] == keys.shape[0]:  # one call over every key
            return layer.attend(q, keys, values, mask=self.blocks[0][3])
        outs = [layer.attend(q[a:b], keys[:m], values[:m], mask=mask) for a, b, m, mask in self.blocks]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _additive_mask(q_positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [num_q, num_keys] (0 visible, -inf hidden) on `q_positions`' device,
    built once: SDPA would convert a boolean one on every call."""
    device = q_positions.device
    visible = causal_by_position_mask(q_positions, torch.arange(num_keys, device=device))  # [num_q, num_keys]
    if device.type != "cuda":
        return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    # CUDA's memory-efficient kernel pads a mask whose rows are not 8-element aligned, a copy per
    # call: rows of an aligned width, sliced, are taken as they are
    width = -(-num_keys // MASK_ALIGNMENT) * MASK_ALIGNMENT
    mask = torch.zeros((visible.shape[0], width), dtype=dtype, device=device)[:, :num_keys]
    return mask.masked_fill_(~visible, float("-inf"))


def attention_probs(q: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor,
                    k_positions: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities of q [n, H, D] over keys [Sk, Hkv, D] -> [H, n, Sk] (float32).

    Causal by true position. GQA is handled by folding the query heads of one KV head together,
    so K is never repeated.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    rep = num_heads // num_kv_heads
    qg = q.float().reshape(n, num_kv_heads, rep, head_dim).permute(1, 2, 0, 3)  # [Hkv, rep, n, D]
    kg = keys.float().permute(1, 2, 0)  # [Hkv, D, Sk]
    scores = torch.matmul(qg.reshape(num_kv_heads, rep * n, head_dim), kg) / math.sqrt(head_dim)
    scores = scores.view(num_kv_heads, rep, n, -1)
    visible = causal_by_position_mask(q_positions, k_positions)  # [n, Sk]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).reshape(num_heads, n, -1)


def attend_with_probs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      q_positions: torch.Tensor, k_positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [n, H * D] (model dtype) and probabilities [H, n, Sk] for few queries."""
    probs = attention_probs(q, keys, q_positions, k_positions)  # [H, n, Sk]
    num_heads, n, _ = probs.shape
    num_kv_heads, head_dim = values.shape[1], values.shape[2]
    rep = num_heads // num_kv_heads
    pg = probs.view(num_kv_heads, rep * n, -1)
    out = torch.matmul(pg, values.float().transpose(0, 1))  # [Hkv, rep * n, D]
    out = out.view(num_heads, n, head_dim).transpose(0, 1).reshape(n, -1)
    return out.to(q.dtype), probs
