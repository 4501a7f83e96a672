"""One decode step for many sequences at once: each sequence's next token over its own KV cache.

In: one token id per sequence and that sequence's `KVCache` (filled by a full prefill or by an
assembled recompute). Out: float32 logits `[num_seqs, vocab]`; each cache gains the new row.

On a CPU a decode step costs reading every weight once, so the sequences share one pass over the
weights (their rows go through each matmul together; see `model.linear` for the small-row kernels)
and only attention runs per sequence, over that sequence's own rows. Sequences may sit at different
positions and join or leave between steps. Equal to `Decoder.decode_step` per sequence up to
floating-point rounding (the identity tests hold it to 1e-4 in float32).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachesmith.errors import InputError
from cachesmith.model.decoder import Decoder
from cachesmith.model.kv_cache import KVCache


# torch's CPU flash kernel, called directly for its log-sum-exp (what merging key splits needs)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
MIN_SPLIT_KEYS = 2048  # fewer keys per split: the merge costs more than the balance gains


def num_key_splits(num_keys: int, num_kv_heads: int, device: torch.device) -> int:
    """How many key ranges one row's attention is cut into so that the CPU's threads share it.

    The flash kernel hands each KV head to one thread, so 3 KV heads on 2 threads run as 2 rounds
    where 1.5 would do; with the keys cut in 2, 6 (head, range) tasks split evenly. Over token-major
    caches a whole float32 step at 4K ran 1.08-1.30x faster (one stream) and 1.17-1.46x (8
    streams). Over the head-major caches decoding reads now, one row's attention (2 threads, keys
    from memory, median of 15 paired rounds) ran 0.93x / 0.94x / 1.04x as fast split at 1K / 2K /
    4K keys in float32 and 0.98x / 1.01x / 1.13x in bfloat16: so only 4K+ keys are split."""
    if device.type != "cpu" or _FLASH_CPU is None:
        return 1
    threads = torch.get_num_threads()
    return max(1, min(threads // math.gcd(threads, num_kv_heads), num_keys // MIN_SPLIT_KEYS))


@dataclass(frozen=True)
class KeySplit:
    """How one sequence's row attends this step, fixed for every layer: `num_ranges` key ranges
    (1: one plain call) and the additive mask [n, 1, 1, length] of their overlaps, if any."""
    num_ranges: int
    mask: torch.Tensor | None = None


def key_split(num_keys: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device) -> KeySplit:
    """The ranges of one row's attention over `num_keys` keys (`num_key_splits`), and their mask."""
    n = num_key_splits(num_keys, num_kv_heads, device)
    return KeySplit(n, overlap_mask(num_keys, n, dtype, device) if n > 1 else None)


def overlap_mask(num_keys: int, num_ranges: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Range j starts at j * step and holds step + T mod n keys, so it overlaps the next by T mod n
    keys; every range but the first masks them out (additive: the flash kernel takes the query's dtype)."""
    step = num_keys // num_ranges
    overlap = num_keys - num_ranges * step
    if not overlap:
        return None
    mask = torch.zeros(num_ranges, 1, 1, step + overlap, dtype=dtype, device=device)
    mask[1:, ..., :overlap] = float("-inf")
    return mask


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_kv_heads: int,
                split: KeySplit) -> torch.Tensor:
    """One query row q [H, D] over keys, values [T, Hkv, D] -> [H * D].

    The query heads sharing a KV head go in as that head's queries ([1, Hkv, H / Hkv, D]): no copy
    of K/V per query head, and no mask (one row sees every key). Measured against expanding GQA, one
    row on 2 CPU threads: 1.4-2x faster in float32 at 1K-4K keys, 1.6x in bfloat16 at 4K, about even in
    bfloat16 at 1K."""
    num_heads, head_dim = q.shape
    grouped = q.view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if split.num_ranges > 1:
        return _attend_split(grouped, keys, values, split)
    out = F.scaled_dot_product_attention(grouped, keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
    return out.reshape(-1)


def _ranges(x: torch.Tensor, num_ranges: int) -> torch.Tensor:
    """x [T, Hkv, D] as `num_ranges` overlapping strided views [n, Hkv, length, D] (no copy)."""
    step = x.shape[0] // num_ranges
    length = x.shape[0] - (num_ranges - 1) * step
    row, head, dim = x.stride()
    return x.as_strided((num_ranges, length, *x.shape[1:]), (step * row, row, head, dim)).transpose(1, 2)


def _attend_split(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, split: KeySplit) -> torch.Tensor:
    """`_attend_one` over the split's key ranges in one kernel call, merged by their log-sum-exp."""
    n = split.num_ranges
    out, lse = _FLASH_CPU(grouped.expand(n, *grouped.shape[1:]), _ranges(keys, n), _ranges(values, n),
                          attn_mask=split.mask)[:2]
    weights = torch.softmax(lse, dim=0)  # [n, Hkv, H / Hkv]: each range's share of the softmax mass
    return (out.float() * weights[..., None]).sum(0).to(keys.dtype).reshape(-1)


@torch.inference_mode()
def decode_step(model: Decoder, token_ids: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
    """Next-token logits [num_seqs, vocab] of each sequence, after its `token_ids[j]` is appended."""
    if len(token_ids) != len(caches) or not caches:
        raise InputError(f"decode_step: {len(token_ids)} token ids for {len(caches)} caches")
    cfg = model.config
    starts = [c.num_tokens for c in caches]
    if max(starts) >= cfg.max_positions:
        raise InputError(f"decode reached the model's maximum of {cfg.max_positions} positions")
    positions = torch.tensor(starts, device=model.device)
    cos, sin = model.rope.cos_sin(positions)  # [num_seqs, 1, head_dim]
    h = model.embed(model.as_token_tensor(token_ids))  # [num_seqs, hidden]
    # each sequence attends over the same number of keys in every layer: decide its split once
    splits = [key_split(start + 1, cfg.num_kv_heads, model.dtype, model.device) for start in starts]
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(layer.input_norm(h))  # [num_seqs, H | Hkv, D]
        q, k = model.rope.apply(q, cos, sin), model.rope.apply(k, cos, sin)
        rows = []
        for j, (cache, start) in enumerate(zip(caches, starts)):
            cache.write(i, start, k[j:j + 1], v[j:j + 1])
            keys, values = cache.view(i, start + 1)
            rows.append(_attend_one(q[j], keys, values, cfg.num_kv_heads, splits[j]))
        attn = torch.stack(rows)  # [num_seqs, H * D]
        h = h + layer.out_proj(attn)
        h = layer.mlp_block(h)
    for cache, start in zip(caches, starts):
        cache.num_tokens = start + 1
    return model.head(model.norm(h))
