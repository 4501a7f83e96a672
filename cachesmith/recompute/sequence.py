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
from cachesmith.model.rope import halves
from cachesmith.recompute.config import check_coverage


@dataclass
class RecomputeRequest:
    chunks: list[ChunkKV]
    suffix_ids: list[int]
    prefix: ChunkKV | None = None  # cached at position 0, hence exact
    coverage: float | None = None  # overrides the plan's coverage for this request
    extra_capacity: int = 0  # cache rows reserved for decoding
    # Staged by the transfer engine: prefix and chunk tensors are views of this cache's rows at
    # their assembled positions, holding pre-RoPE K as stored (the runner rotates them in place).
    cache: KVCache | None = None


@dataclass
class Sequence:
    request: RecomputeRequest
    coverage: float
    token_ids: torch.Tensor  # [S]
    cos: torch.Tensor  # [S, 1, head_dim // 2] (`rope.halves`: what every rotation reads)
    sin: torch.Tensor  # [S, 1, head_dim // 2]
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
    qci_entropy: torch.Tensor | None = None  # 0-dim, on the model's device (`signals.entropy_of`)
    placed_layers: set[int] = field(default_factory=set)  # layers whose cached rows are placed, rotated
    is_stitched: bool = False  # in-memory entries copied into the cache, every layer (`stitch_cached_rows`)

    @property
    def is_staged(self) -> bool:
        return self.request.cache is not None

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_context + self.num_suffix

    @property
    def context_start(self) -> int:
        return self.num_prefix

    @property
    def suffix_start(self) -> int:
        return self.num_prefix + self.num_context


def entries_of(req: RecomputeRequest) -> list[ChunkKV]:
    """Prefix (if any) and chunks, in their assembled order."""
    return ([req.prefix] if req.prefix is not None else []) + list(req.chunks)


def checked(model: Decoder, req: RecomputeRequest, coverage: float, index: int) -> tuple[float, torch.Tensor]:
    """The request's coverage (its own, else the plan's) and its suffix ids as given (a host tensor
    for a list), once every field is checked against the model (an error naming the field)."""
    field_name = f"requests[{index}]"
    if not req.suffix_ids:
        raise InputError(f"{field_name}.suffix_ids is empty: the question must hold at least one token")
    coverage = check_coverage(req.coverage if req.coverage is not None else coverage,
                              f"{field_name}.coverage")
    for j, entry in enumerate(entries_of(req)):
        name = f"{field_name}.prefix" if req.prefix is not None and j == 0 else \
            f"{field_name}.chunks[{j - (req.prefix is not None)}]"
        entry.check_compatible(model, name)
    num_cached = sum(e.num_tokens for e in entries_of(req))
    return coverage, model.checked_token_ids(req.suffix_ids, f"{field_name}.suffix_ids", start=num_cached)


def chunk_starts(req: RecomputeRequest) -> list[int]:
    """Each chunk's start within the context (the prefix excluded)."""
    starts, at = [], 0
    for chunk in req.chunks:
        starts.append(at)
        at += chunk.num_tokens
    return starts


def build_sequence(model: Decoder, req: RecomputeRequest, coverage: float, index: int) -> Sequence:
    field_name = f"requests[{index}]"
    coverage, suffix = checked(model, req, coverage, index)
    suffix = suffix.to(model.device)
    entries = entries_of(req)
    num_prefix = req.prefix.num_tokens if req.prefix is not None else 0
    num_context = sum(c.num_tokens for c in req.chunks)
    # no entries (a plain chat without a stored prefix): an empty long tensor, not torch's float default
    token_ids = torch.cat([torch.tensor([t for e in entries for t in e.token_ids], dtype=suffix.dtype,
                                        device=model.device), suffix])
    segments, start = [], 0
    for entry in entries:
        segments.append((start, entry))
        start += entry.num_tokens
    num_tokens = token_ids.numel()
    cos, sin = halves(*model.rope.cos_sin_range(0, num_tokens), model.config.head_dim // 2)
    return Sequence(
        request=req, coverage=coverage, token_ids=token_ids, cos=cos, sin=sin, segments=segments,
        num_prefix=num_prefix, num_context=num_context, num_suffix=suffix.numel(),
        cache=_request_cache(model, req, num_tokens, field_name), chunk_starts=chunk_starts(req),
    )


def _request_cache(model: Decoder, req: RecomputeRequest, num_tokens: int, field_name: str) -> KVCache:
    if req.cache is None:
        return model.new_cache(num_tokens + req.extra_capacity)
    if req.cache.num_tokens:  # its cached K were rotated in place by the run that filled it
        raise InputError(f"{field_name}.cache was already run: a staged request runs once")
    if req.cache.capacity < num_tokens:
        raise InputError(f"{field_name}.cache holds {req.cache.capacity} rows, the request needs {num_tokens}")
    return req.cache


def stitch_cached_rows(model: Decoder, seq: Sequence) -> None:
    """Place the K and V of prefix and chunks handed in memory into the cache, every layer at once,
    before the layer loop: one concatenation per tensor and one rotation of every layer's K, however
    many chunks and layers, where a copy per chunk and layer made the loop's host work grow with the
    number of chunks. WarmUp layers overwrite their rows with fresh ones. A staged request's rows
    arrive layer by layer instead, and are rotated as each layer is reached (`fill_cached_rows`)."""
    if seq.is_staged or seq.is_stitched or not seq.segments:
        return
    end = seq.suffix_start
    entries = [entry for _, entry in seq.segments]
    keys = seq.cache.key_slab[:, :end]  # [L, end, Hkv, D]
    torch.cat([e.keys for e in entries], dim=1, out=keys)
    torch.cat([e.values for e in entries], dim=1, out=seq.cache.value_slab[:, :end])
    model.rope.apply_(keys, seq.cos[:end], seq.sin[:end])  # every layer's rows rotated at once
    seq.is_stitched = True
    seq.placed_layers.update(range(keys.shape[0]))


def fill_cached_rows(model: Decoder, seq: Sequence, layer: int) -> int:
    """Rotate the cached K of prefix and chunks in the layer's cache buffer to their assembled
    positions, once: a QCI probe fills a layer, and Patch revisits it after the rewind (probes only
    write suffix rows, which Patch rewrites). The rows are already in the buffer, pre-RoPE: staged
    there by the transfer engine, or stitched (`stitch_cached_rows`). Returns the number of cached
    rows."""
    end = seq.suffix_start
    if layer in seq.placed_layers:
        return end
    if not (seq.is_staged or not seq.segments):
        raise RuntimeError("cached rows read before the request's chunks were stitched into its cache")
    seq.placed_layers.add(layer)
    model.rope.apply_(seq.cache.keys[layer][:end], seq.cos[:end], seq.sin[:end])
    return end
