"""Scattered-row attention split into an unmasked key prefix and a masked diagonal, merged by LSE.

For a block of query rows at sorted positions [lo .. hi], every key before `lo` is visible to all of
them, so that part needs no mask; only keys in [lo, hi] need one. Each part runs PyTorch's CPU flash
kernel, which returns the log-sum-exp of each row, and the two partial softmaxes are merged exactly:
  lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
The query heads of one KV head are folded into its rows instead of repeating K/V (torch 2.13's
kernel also maps grouped query heads to their KV head itself; in bfloat16 that measured no slower). Measured on 4K keys with 15% scattered rows (float32, 2 cores): 0.20-0.23 of a full
causal attention, against 0.30 for masked blocks (docs/adr/0015-scattered-attention.md); at 2K keys the two are even. CPU float32 only; elsewhere, and when
the kernel is absent, `ScatteredAttention` (masked blocks) is used. In bfloat16 the kernel runs (it
takes bfloat16 on CPU), but re-measured with blocks of 64-256 rows, folded or not, it is no faster
than masked blocks of up to 256 rows (docs/adr/0015-scattered-attention.md), so it stays float32-only.
"""
from __future__ import annotations

import torch

from cachesmith.model.layers import DecoderLayer, causal_by_position_mask

ROWS_PER_BLOCK = 64  # fewer rows per call and the per-call cost dominates (measured 2K / 4K keys)
MAX_BLOCKS = 8
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return _FLASH_CPU is not None and device.type == "cpu" and dtype == torch.float32


class SplitAttention:
    """Block plan for query rows at sorted `q_positions` (CPU tensor); masks built once per request."""

    def __init__(self, q_positions: torch.Tensor, num_suffix: int, num_heads: int, num_kv_heads: int,
                 num_blocks: int | None = None) -> None:
        self.rep = num_heads // num_kv_heads
        num_q = q_positions.numel()
        num_scattered = num_q - num_suffix
        if num_blocks is None:
            num_blocks = max(4, min(MAX_BLOCKS, num_scattered // ROWS_PER_BLOCK))
        groups = min(num_blocks, num_scattered)
        bounds = [num_scattered * g // groups for g in range(groups + 1)] if groups else [0]
        bounds.append(num_q)
        self.blocks: list[tuple[int, int, int, int, torch.Tensor]] = []
        host_positions = q_positions.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b <= a:
                continue
            lo, hi = host_positions[a], host_positions[b - 1] + 1
            visible = causal_by_position_mask(q_positions[a:b], torch.arange(lo, hi))  # [b - a, hi - lo]
            mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            self.blocks.append((a, b, lo, hi, mask.repeat(self.rep, 1)))  # rows folded r-major

    def __call__(self, layer: DecoderLayer, q: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
        """q [num_q, H, D]; keys/values [S, Hkv, D] -> [num_q, H * D]."""
        num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
        k4, v4 = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hkv, S, D]
        outs = []
        for a, b, lo, hi, mask in self.blocks:
            n = b - a
            qf = q[a:b].view(n, num_kv_heads, self.rep, head_dim).permute(1, 2, 0, 3)
            qf = qf.reshape(1, num_kv_heads, self.rep * n, head_dim)
            out, lse = _FLASH_CPU(qf, k4[:, :, lo:hi], v4[:, :, lo:hi], attn_mask=mask)[:2]
            if lo > 0:
                out_a, lse_a = _FLASH_CPU(qf, k4[:, :, :lo], v4[:, :, :lo])[:2]
                total = torch.logaddexp(lse_a, lse)
                out = out_a * torch.exp(lse_a - total)[..., None] + out * torch.exp(lse - total)[..., None]
            out = out.view(num_kv_heads, self.rep, n, head_dim).permute(2, 0, 1, 3)  # [n, Hkv, rep, D]
            outs.append(out.reshape(n, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
