"""A growable KV cache of one sequence, holding rotated K and V, and the pool its slabs come from.

In: K/V rows written per layer at explicit start offsets (by full prefill, by the recompute
runner's assembled cache, or straight from the store by the transfer engine). Out: views
`[:num_tokens]` per layer for attention.

K and V each live in one slab `[num_layers, capacity, Hkv, D]`, so the rows of one chunk across all
layers form a single view (`rows(a, b)`): the transfer engine stages stored chunk KV directly into
the cache that decoding will use, with no staging copy. Slabs come from a `SlabPool`: on the
machines we serve from, touching fresh pages costs far more than copying into memory that is
already mapped (1 GB: 2.2 s fresh against 0.12 s reused, docs/decisions.md), so a released cache
hands its slabs to the next one.
"""
from __future__ import annotations

import threading

import torch


class SlabPool:
    """Keeps released slabs for reuse, up to `max_bytes`; a slab is reused for a request needing at
    least half its rows (less would waste more memory than the page faults it saves)."""

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_reused = 0
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A slab of `shape` ([L, capacity, Hkv, D]) or larger in capacity (dim 1)."""
        with self._lock:
            best = None
            for i, slab in enumerate(self._free):
                if (slab.dtype == dtype and slab.device == device and slab.shape[0] == shape[0]
                        and slab.shape[2:] == shape[2:] and shape[1] <= slab.shape[1] <= 2 * shape[1]
                        and (best is None or slab.shape[1] < self._free[best].shape[1])):
                    best = i
            if best is not None:
                slab = self._free.pop(best)
                self.num_bytes -= _nbytes(slab)
                self.num_reused += 1
                return slab
        return torch.empty(shape, device=device, dtype=dtype)

    def give(self, slab: torch.Tensor) -> None:
        with self._lock:
            size = _nbytes(slab)
            while self._free and self.num_bytes + size > self.max_bytes:
                self.num_bytes -= _nbytes(self._free.pop(0))  # oldest first
            if size <= self.max_bytes:
                self._free.append(slab)
                self.num_bytes += size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device, dtype: torch.dtype, pool: SlabPool | None = None) -> None:
        shape = (num_layers, max(capacity, 1), num_kv_heads, head_dim)
        self.pool = pool
        take = pool.take if pool is not None else (lambda s, d, t: torch.empty(s, device=d, dtype=t))
        self.key_slab = take(shape, device, dtype)  # [L, capacity, Hkv, D]
        self.value_slab = take(shape, device, dtype)
        self._set_views()
        self.num_tokens = 0  # rows valid in every layer

    def _set_views(self) -> None:
        self.keys = list(self.key_slab.unbind(0))  # per layer [capacity, Hkv, D]
        self.values = list(self.value_slab.unbind(0))

    @property
    def capacity(self) -> int:
        return self.key_slab.shape[1]

    def _grow(self, min_capacity: int) -> None:
        new_capacity = max(min_capacity, 2 * self.capacity)
        slabs = []
        for old in (self.key_slab, self.value_slab):
            new = old.new_empty((old.shape[0], new_capacity, *old.shape[2:]))
            new[:, : old.shape[1]] = old
            slabs.append(new)
            if self.pool is not None:
                self.pool.give(old)
        self.key_slab, self.value_slab = slabs
        self._set_views()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rotated k, v [num_rows, Hkv, D] at rows [start, start + num_rows) of `layer`."""
        end = start + k.shape[0]
        if end > self.capacity:
            self._grow(end)
        self.keys[layer][start:end] = k
        self.values[layer][start:end] = v

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [end, Hkv, D] of `layer` (default: all valid rows)."""
        end = self.num_tokens if end is None else end
        return self.keys[layer][:end], self.values[layer][:end]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, end - start, Hkv, D] of rows [start, end) in every layer (views)."""
        return self.key_slab[:, start:end], self.value_slab[:, start:end]

    def clone(self, num_layers: int | None = None) -> "KVCache":
        """A new cache of the same capacity holding a copy of the first `num_layers` layers (default
        all); the other layers are left unset, as in a fresh cache."""
        L, capacity, num_kv_heads, head_dim = self.key_slab.shape
        out = KVCache(L, num_kv_heads, head_dim, capacity, self.key_slab.device, self.key_slab.dtype, self.pool)
        n = L if num_layers is None else num_layers
        out.key_slab[:n, :capacity] = self.key_slab[:n]  # a pooled slab may hold more rows
        out.value_slab[:n, :capacity] = self.value_slab[:n]
        out.num_tokens = self.num_tokens
        return out

    def release(self) -> None:
        """Hand the slabs back to the pool; the cache (and every view of it) must not be used after."""
        if self.pool is not None and self.key_slab is not None:
            self.pool.give(self.key_slab)
            self.pool.give(self.value_slab)
        self.key_slab = self.value_slab = None
        self.keys, self.values = [], []
        self.num_tokens = 0
