"""Shared builders for recompute tests on tiny random models."""
from __future__ import annotations

import torch

from cachesmith.model import Decoder, prefill_chunk
from cachesmith.model.layers import causal_by_position_mask
from cachesmith.recompute import RecomputeRequest


def make_request(model: Decoder, seed: int, chunk_lens=(9, 12, 7), prefix_len=5, suffix_len=6,
                 coverage=None) -> tuple[RecomputeRequest, list[int]]:
    """A request of random tokens and the flat token ids full prefill would see."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefix = ids(prefix_len) if prefix_len else []
    chunks = [ids(n) for n in chunk_lens]
    suffix = ids(suffix_len)
    req = RecomputeRequest(
        chunks=[prefill_chunk(model, c) for c in chunks],
        suffix_ids=suffix,
        prefix=prefill_chunk(model, prefix) if prefix else None,
        coverage=coverage,
    )
    return req, prefix + [t for c in chunks for t in c] + suffix


def reference_full_reuse(model: Decoder, req: RecomputeRequest) -> torch.Tensor:
    """Stitched cache + recomputed suffix, written plainly with one explicit mask per layer."""
    entries = ([req.prefix] if req.prefix is not None else []) + list(req.chunks)
    num_cached = sum(e.num_tokens for e in entries)
    suffix = torch.tensor(req.suffix_ids)
    q_pos = torch.arange(num_cached, num_cached + suffix.numel())
    k_pos = torch.arange(num_cached + suffix.numel())
    with torch.inference_mode():
        h = model.embed(suffix)
        for i, layer in enumerate(model.layers):
            cached_k = torch.cat([e.keys[i] for e in entries])
            cached_k = model.rope.rotate(cached_k, torch.arange(num_cached))
            cached_v = torch.cat([e.values[i] for e in entries])
            q, k, v = layer.qkv(layer.input_norm(h))
            q, k = model.rope.rotate(q, q_pos), model.rope.rotate(k, q_pos)
            mask = causal_by_position_mask(q_pos, k_pos)
            attn = layer.attend(q, torch.cat([cached_k, k]), torch.cat([cached_v, v]), mask=mask)
            h = layer.mlp_block(h + layer.out_proj(attn))
        return model.head(model.norm(h[-1:]))[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
