"""One request of a recompute batch and its assembled layout.

In: a `RecomputeRequest` (cached prefix, ordered cached chunks, suffix ids, coverage).
Out: a `Sequence` holding positions, RoPE tables, the request's KV cache buffer (which becomes the
decode cache), and the mutable selection state the runner updates layer by layer.

Layout: [prefix P | chunk 1 | ... | chunk K | suffix n], positions 0..S-1; context = the chunks (N).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cachesmith.errors import InputError
from cachesmith.model import ChunkKV, Decoder, KVCache
from cachesmith.recompute.config import check_coverage


@dataclass
class RecomputeRequest:
    chunks: list[ChunkKV]
    suffix_ids: list[int]
    prefix: ChunkKV | None = None  # cached at position 0, hence exact
    coverage: float | None = None  # overrides the plan's coverage for this request
    extra_capacity: int = 0  # cache rows reserved for decoding


@dataclass
class Sequence:
    request: RecomputeRequest
    coverage: float
    token_ids: torch.Tensor  # [S]
    cos: torch.Tensor  # [S, 1, head_dim]
    sin: torch.Tensor  # [S, 1, head_dim]
    segments: list[tuple[int, ChunkKV]]  # (start position, cached entry) for prefix and chunks
    num_prefix: int
    num_context: int
    num_suffix: int
    cache: KVCache
    chunk_starts: list[int] = field(default_factory=list)  # context-relative start of each chunk
    ranking: torch.Tensor | None = None  # context indices, best first (CPU, long)
    selected: torch.Tensor | None = None  # sorted context indices recomputed in Patch (CPU, long)
    scores: torch.Tensor | None = None  # [N] selection scores
    is_position_signal: bool = False
    qci_entropy: float | None = None
    filled_layers: set[int] = field(default_factory=set)  # layers whose cached rows are in `cache`

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_context + self.num_suffix

    @property
    def context_start(self) -> int:
        return self.num_prefix

    @property
    def suffix_start(self) -> int:
        return self.num_prefix + self.num_context


def build_sequence(model: Decoder, req: RecomputeRequest, coverage: float, index: int) -> Sequence:
    field_name = f"requests[{index}]"
    if not req.chunks:
        raise InputError(f"{field_name}.chunks is empty: a request needs at least one cached chunk")
    if not req.suffix_ids:
        raise InputError(f"{field_name}.suffix_ids is empty: the question must hold at least one token")
    coverage = check_coverage(req.coverage if req.coverage is not None else coverage,
                              f"{field_name}.coverage")
    entries = ([req.prefix] if req.prefix is not None else []) + list(req.chunks)
    for j, entry in enumerate(entries):
        name = f"{field_name}.prefix" if req.prefix is not None and j == 0 else \
            f"{field_name}.chunks[{j - (req.prefix is not None)}]"
        entry.check_compatible(model, name)
    num_prefix = req.prefix.num_tokens if req.prefix is not None else 0
    num_context = sum(c.num_tokens for c in req.chunks)
    suffix = model.as_token_tensor(req.suffix_ids, f"{field_name}.suffix_ids",
                                   start=num_prefix + num_context)
    token_ids = torch.cat([torch.tensor([t for e in entries for t in e.token_ids], device=model.device),
                           suffix])
    segments, start, chunk_starts = [], 0, []
    for entry in entries:
        segments.append((start, entry))
        if entry is not req.prefix:
            chunk_starts.append(start - num_prefix)
        start += entry.num_tokens
    num_tokens = token_ids.numel()
    cos, sin = model.rope.cos_sin(torch.arange(num_tokens, device=model.device))
    return Sequence(
        request=req, coverage=coverage, token_ids=token_ids, cos=cos, sin=sin, segments=segments,
        num_prefix=num_prefix, num_context=num_context, num_suffix=suffix.numel(),
        cache=model.new_cache(num_tokens + req.extra_capacity), chunk_starts=chunk_starts,
    )


def fill_cached_rows(model: Decoder, seq: Sequence, layer: int) -> int:
    """Place the cached K (rotated to its assembled positions) and V of prefix and chunks into the
    layer's cache buffer, once: a QCI probe fills a layer, and Patch revisits it after the rewind
    (probes only write suffix rows, which Patch rewrites). Returns the number of cached rows."""
    if layer in seq.filled_layers:
        return seq.suffix_start
    seq.filled_layers.add(layer)
    keys, values = seq.cache.keys[layer], seq.cache.values[layer]
    for start, entry in seq.segments:
        end = start + entry.num_tokens
        model.rope.apply(entry.keys[layer], seq.cos[start:end], seq.sin[start:end], out=keys[start:end])
        values[start:end] = entry.values[layer]
    return seq.suffix_start


def cached_pre_rope(seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE cached K and V of the context rows [N, Hkv, D] (prefix excluded)."""
    chunks = [e for _, e in seq.segments[1 if seq.request.prefix is not None else 0:]]
    return (torch.cat([c.keys[layer] for c in chunks]), torch.cat([c.values[layer] for c in chunks]))
