"""One decoding row's attention over its own sequence's cache through torch's kernels, and the
measurement of whether the native kernel beats them.

In: a row's rotated queries `[num_heads, head_dim]` and its cache's keys and values
`[num_keys, num_kv_heads, head_dim]` (either cache layout). Out: the attention output
`[num_heads * head_dim]`, from torch's CPU flash kernel, with the keys cut into ranges the threads
share (`KeySplit`) on long contexts. `tune_native_attention` times `model.native`'s kernel against
this path at load; where it wins, decode steps attend through it instead (`model.decode`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachesmith.model import native

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


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_kv_heads: int,
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
    """`attend_one` over the split's key ranges in one kernel call, merged by their log-sum-exp."""
    n = split.num_ranges
    out, lse = _FLASH_CPU(grouped.expand(n, *grouped.shape[1:]), _ranges(keys, n), _ranges(values, n),
                          attn_mask=split.mask)[:2]
    weights = torch.softmax(lse, dim=0)  # [n, Hkv, H / Hkv]: each range's share of the softmax mass
    return (out.float() * weights[..., None]).sum(0).to(keys.dtype).reshape(-1)




@torch.inference_mode()
def tune_native_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          num_keys: int = 1024, repeats: int = 3) -> bool:
    """Whether the native kernel attends one row over `num_keys` keys of a head-major cache (what
    decoding reads) clearly faster than the torch path, here: best of `repeats` passes over 16
    distinct caches (so both read from memory, as a decode step's layers do), alternating."""
    if not native.supports_attention(dtype, head_dim):
        return False
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_kv_heads, num_keys, head_dim, generator=g).to(dtype).transpose(1, 2)
              for _ in range(16)]  # [2, T, Hkv, D] views of head-major K and V
    q = torch.randn(num_heads, head_dim, generator=g).to(dtype)
    split = key_split(num_keys, num_kv_heads, dtype, q.device)
    # a decode step describes its caches once and attends through them in every layer
    layouts = [native.kv_layouts([cache[0]], [cache[1]], [num_keys]) for cache in caches]

    def one_pass(is_native: bool) -> float:
        start = time.perf_counter()
        for cache, layout in zip(caches, layouts):
            if is_native:
                native.decode_attention(q[None], num_kv_heads, layout)
            else:
                attend_one(q, cache[0], cache[1], num_kv_heads, split)
        return time.perf_counter() - start
    torch_s, native_s = float("inf"), float("inf")
    for _ in range(repeats):
        torch_s = min(torch_s, one_pass(False))
        native_s = min(native_s, one_pass(True))
    return native_s < 0.9 * torch_s  # a clear margin: the timing shares the machine
