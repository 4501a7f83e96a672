"""One decoder layer, split into separately callable pieces.

The recompute runner (not this module) owns the layer loop and decides which tokens run which
piece: `input_norm` -> `qkv` (pre-RoPE) -> rotate -> `attend` (given queries over given K/V with a
causal-by-position mask) -> `out_proj` + residual -> `post_norm` -> `mlp` + residual.
Tensors carry no batch dimension: rows are tokens, as in vLLM's flattened layout.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from cachesmith.model import device as accel
from cachesmith.model.config import ModelConfig
from cachesmith.model.linear import Linear


class RMSNorm:
    """RMSNorm computed in float32 and cast back, matching transformers' Llama/Qwen norms."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # [dim]
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # fused kernel; same arithmetic as the float32 upcast path
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # bfloat16 / float16: transformers rounds x * rsqrt(mean(x^2) + eps), computed in float32,
        # to the model dtype and then multiplies by the weight in the model dtype. F.rms_norm
        # without a weight does the first step on low-precision input (float32 inside, one
        # rounding), so no float32 copy of x is made; bit-identical to the upcast path.
        return F.rms_norm(x, self.weight.shape, eps=self.eps).mul_(self.weight)


def causal_by_position_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask [num_q, num_k]: key j is visible to query i iff pos(j) <= pos(i)."""
    return k_positions[None, :] <= q_positions[:, None]


def _needs_expanded_heads(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether grouped query heads must meet expanded KV heads rather than `enable_gqa` (CUDA).

    Where no fused CUDA kernel takes these inputs with `enable_gqa` (torch 2.13's flash kernel
    takes no mask and only half precision, its memory-efficient one no `enable_gqa`; cuDNN, tried
    first on an H100 by newer builds, takes both), the math kernel would build the whole float32
    score matrix (about 10 GB per buffer at 16K keys with 30% of rows recomputed). Repeating K and
    V costs (H / Hkv - 1) copies of one layer's KV instead, so it is done only there: the device is
    asked once per kind of call (`_is_gqa_fused`). The CPU keeps `enable_gqa`: its flash kernel
    maps the heads itself and takes a mask (measured fastest)."""
    if q.device.type != "cuda":
        return False
    return not _is_gqa_fused(q.dtype, q.shape[-1], q.shape[1] // k.shape[1], mask is not None, is_causal)


@functools.lru_cache(maxsize=64)
def _is_gqa_fused(dtype: torch.dtype, head_dim: int, group: int, is_masked: bool, is_causal: bool) -> bool:
    """Whether the CUDA build runs a fused kernel for grouped-query attention of this kind (a probe
    on small tensors of the same dtype, head size and grouping: torch's checks read only those)."""
    n, device = 16, accel.normalize("cuda")
    q = torch.zeros(1, group, n, head_dim, dtype=dtype, device=device)
    k = torch.zeros(1, 1, n, head_dim, dtype=dtype, device=device)
    mask = torch.ones(n, n, dtype=torch.bool, device=device) if is_masked else None
    return accel.sdpa_kernels(q, k, k, mask, is_causal and not is_masked, True)["picked"] != "math"


def grouped_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A batch's mask [B, Tq, Tk] for `DecoderLayer.attend_grouped`: [B, 1, group * Tq, Tk], each
    query head of a group seeing what its row sees (built once per run: every layer reads it)."""
    B, Tq, Tk = mask.shape
    return mask[:, None].expand(B, group, Tq, Tk).reshape(B, 1, group * Tq, Tk)


class DecoderLayer:
    """Weights of one layer; Q, K and V are fused into one matmul."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.input_norm = RMSNorm(weights["input_norm"], config.rms_norm_eps)
        self.post_norm = RMSNorm(weights["post_norm"], config.rms_norm_eps)
        self.qkv_weight = weights["qkv"]  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
        self.qkv_bias = weights.get("qkv_bias")
        self.qkv_proj = Linear(self.qkv_weight, self.qkv_bias)
        self.q_norm = RMSNorm(weights["q_norm"], config.rms_norm_eps) if config.is_qk_norm else None
        self.k_norm = RMSNorm(weights["k_norm"], config.rms_norm_eps) if config.is_qk_norm else None
        self.o_proj = Linear(weights["o"])  # [hidden, num_heads * head_dim]
        # One [2 * intermediate, hidden] matrix: few rows (decode) read it in one packed call,
        # many rows (prefill) read its two halves as separate contiguous weights (see `mlp`).
        gate_up = torch.cat([weights["gate"], weights["up"]])
        self.gate_up_proj = Linear(gate_up)
        self.gate_proj = Linear(gate_up[: config.intermediate_size], is_packed=False)
        self.up_proj = Linear(gate_up[config.intermediate_size:], is_packed=False)
        self.down_proj = Linear(weights["down"])  # [hidden, intermediate]
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The matrices a decode step multiplies, in order (gate and up as their one matrix)."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden x [num_tokens, hidden] -> pre-RoPE q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""
        cfg = self.config
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self._q_size, self._kv_size, self._kv_size), dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def qk_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed hidden x [T, hidden] -> pre-RoPE q and k side by side, qk [T, H + Hkv, D] (query
        heads first), and v [T, Hkv, D]: one rotation then serves both, half the launches of two."""
        cfg = self.config
        qk, v = self.qkv_proj(x).split((self._q_size + self._kv_size, self._kv_size), dim=-1)
        qk = qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : cfg.num_heads]), self.k_norm(qk[:, cfg.num_heads:])], dim=1)
        return qk, v

    def q(self, x: torch.Tensor) -> torch.Tensor:
        """Query only: normed hidden [T, hidden] -> pre-RoPE q [T, H, D]."""
        bias = None if self.qkv_bias is None else self.qkv_bias[: self._q_size]
        q = F.linear(x, self.qkv_weight[: self._q_size], bias).view(-1, self.config.num_heads,
                                                                     self.config.head_dim)
        return q if self.q_norm is None else self.q_norm(q)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value only (what KV deviation needs): -> pre-RoPE k, v [T, Hkv, D]."""
        cfg = self.config
        bias = None if self.qkv_bias is None else self.qkv_bias[self._q_size:]
        k, v = F.linear(x, self.qkv_weight[self._q_size:], bias).split(self._kv_size, dim=-1)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        return (k if self.k_norm is None else self.k_norm(k)), v.view(-1, cfg.num_kv_heads, cfg.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """Rotated q [Tq, H, D] over rotated k, v [Tk, Hkv, D] -> [Tq, H * D].

        `mask` [Tq, Tk] (True = visible) expresses causality by true position; `is_causal` is the
        fast path when queries and keys are the same contiguous positions.
        """
        # A leading batch dim of 1: torch's CPU flash kernel only takes 4-D inputs (3-D falls
        # back to the math path, ~9x slower at 2K tokens).
        q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        is_gqa = q.shape[1] != k.shape[1]
        if is_gqa and _needs_expanded_heads(q, k, mask, is_causal):
            rep = q.shape[1] // k.shape[1]
            k4, v4 = k4.repeat_interleave(rep, dim=1), v4.repeat_interleave(rep, dim=1)  # [1, H, Tk, D]
            is_gqa = False
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=is_gqa)[0]  # [H, Tq, D]
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def attend_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """`attend` for a batch of padded sequences: q [B, Tq, H, D] over k, v [B, Tk, Hkv, D]
        (views of a static slab may be strided) -> [B * Tq, H * D]; `mask` [B, Tq, Tk] (True =
        visible). One call for the batch, the kernel chosen as `attend` chooses it."""
        q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H | Hkv, T, D]
        is_gqa = q.shape[2] != k.shape[2]
        if is_gqa and _needs_expanded_heads(q[0], k[0], mask, is_causal):
            rep = q.shape[2] // k.shape[2]
            k4, v4 = k4.repeat_interleave(rep, dim=1), v4.repeat_interleave(rep, dim=1)  # [B, H, Tk, D]
            is_gqa = False
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=None if mask is None else mask[:, None],
                                             is_causal=is_causal, enable_gqa=is_gqa)  # [B, H, Tq, D]
        return out.transpose(1, 2).reshape(q.shape[0] * q.shape[1], -1)

    def attend_grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`attend_batch` with a mask, K/V never expanded per query head: the query heads sharing
        a KV head go in as its rows (graph_decode's layout), so one fused CUDA kernel takes the
        call with no `enable_gqa`. q [B, Tq, H, D], k, v [B, Tk, Hkv, D], `mask` from
        `grouped_mask` [B, 1, group * Tq, Tk] -> [B * Tq, H * D]."""
        B, Tq, H, D = q.shape
        Hkv = k.shape[2]
        group = H // Hkv
        rows = q.reshape(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Tq, D)
        out = F.scaled_dot_product_attention(rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.view(B, Hkv, group, Tq, D).permute(0, 3, 1, 2, 4).reshape(B * Tq, H * D)

    def out_proj(self, attn: torch.Tensor) -> torch.Tensor:
        """[num_tokens, H * D] -> [num_tokens, hidden]."""
        return self.o_proj(attn)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Post-normed hidden [num_tokens, hidden] -> [num_tokens, hidden] (SwiGLU)."""
        if self.gate_up_proj.is_native_for(x) or self.gate_up_proj.is_packed_for(x):
            # Few rows cost reading the weights: one call over gate and up reads them faster than
            # two (oneDNN, bfloat16, one row: 22 against 16 GB/s on a 2-core machine).
            gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
            gate = F.silu(gate_up[:, : self.config.intermediate_size])  # contiguous for down_proj
            return self.down_proj(gate.mul_(gate_up[:, self.config.intermediate_size:]))
        # Many rows: two matmuls rather than one fused: the down projection then reads a
        # contiguous input (measured faster at 4K tokens), and SiLU * up runs in place (a fresh
        # [T, intermediate] tensor costs page faults on CPU).
        gate = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(gate.mul_(self.up_proj(x)))

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """Residual MLP sub-block h + mlp(post_norm(h)), added into `h` in place and returned."""
        return h.add_(self.mlp(self.post_norm(h)))
