"""Rotary position embedding at explicit positions.

In: pre-RoPE query or key rows `[num_tokens, num_heads, head_dim]` and their absolute positions
(on the host, or on the device with their bound known on the host: `cos_sin_at`).
Out: the same rows rotated to those positions. Positions are explicit everywhere so that cached
chunk K (stored pre-RoPE) can be placed at any offset with exactly the rotation a full prefill uses.
"""
from __future__ import annotations

import torch

from cachesmith.errors import ModelAssetError


def _inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, delegated to transformers for non-default types."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        # dynamic scaling changes frequencies with sequence length, so cached K would not compose.
        raise ModelAssetError(f"rope_type={rope_type!r} is not supported (position-independent types only)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


def halves(cos: torch.Tensor, sin: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first halves of cos/sin rows [T, 1, 2 * half] (either half serves: each frequency is
    there twice), or the rows as given when they are halves already: a caller rotating the same
    positions many times (every layer) slices once."""
    if cos.shape[-1] == half:
        return cos, sin
    return cos[..., :half], sin[..., :half]


class RotaryEmbedding:
    """cos/sin tables computed in float32 (as transformers does) and cast to the model dtype."""

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq, self.attention_scaling = _inv_freq(hf_config)
        self.inv_freq = inv_freq.to(device)  # [head_dim // 2]
        self.dtype = dtype
        self._cos = self._sin = None  # [num_positions, 1, head_dim] tables, grown on demand

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] in the model dtype.

        Rows of one table computed once (elementwise, so each row is what computing it alone
        gives): every request of every batch needs them, and computing them costs more than
        indexing them. Contiguous positions come back as views."""
        if positions.numel() == 0:
            return self._tables(positions)
        needed = int(positions.max()) + 1
        self._reserve(needed)
        first = int(positions[0])
        if positions.numel() == needed - first and bool((positions.diff() == 1).all()):
            return self._cos[first:needed], self._sin[first:needed]  # a contiguous run: views
        return self._cos[positions], self._sin[positions]

    def cos_sin_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` of positions [start, end), known on the host: views of the tables, and no value
        is read back from the device to find them."""
        self._reserve(end)
        return self._cos[start:end], self._sin[start:end]

    def cos_sin_at(self, positions: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` of positions [num_tokens] that live on the device, all below `num_positions`
        (known on the host, e.g. from the caches' lengths): one gather per table, and no value is
        read back from the device (what a decode step needs to stay free of host syncs)."""
        self._reserve(num_positions)
        return self._cos[positions], self._sin[positions]

    def _reserve(self, num_positions: int) -> None:
        if self._cos is None or self._cos.shape[0] < num_positions:
            size = max(num_positions, 2 * (0 if self._cos is None else self._cos.shape[0]), 4096)
            self._cos, self._sin = self._tables(torch.arange(size, device=self.inv_freq.device))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, num_heads, head_dim] rotated with precomputed cos/sin (into `out` if given,
        e.g. straight into a KV cache buffer). cos/sin may be the tables' rows [T, 1, head_dim] or
        their first halves [T, 1, head_dim // 2] (`halves`)."""
        # Written per half instead of cat(-x2, x1): no extra [T, H, D] temporaries (cos and sin
        # hold each frequency twice, so either half of them serves both halves of x).
        half = x.shape[-1] // 2
        x1, x2 = x.split((half, half), dim=-1)  # one dispatch for both views
        c, s = halves(cos, sin, half)
        out = torch.empty_like(x) if out is None else out
        out1, out2 = out.split((half, half), dim=-1)
        torch.mul(x1, c, out=out1)
        out1.addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=out2)
        out2.addcmul_(x1, s)
        return out

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim] in place (e.g. cached K staged pre-RoPE into a
        KV cache); bit-identical to `apply`, with one half-size temporary."""
        half = x.shape[-1] // 2
        x1, x2 = x.split((half, half), dim=-1)
        c, s = halves(cos, sin, half)
        first = torch.mul(x1, c)
        first.addcmul_(x2, s, value=-1)
        x2.mul_(c).addcmul_(x1, s)
        x1.copy_(first)
        return x

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, num_heads, head_dim] pre-RoPE -> rotated to `positions` [num_tokens]."""
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos, sin)
