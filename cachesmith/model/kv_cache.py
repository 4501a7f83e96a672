"""A growable per-layer KV cache of one sequence, holding rotated K and V, for decoding.

In: K/V rows written per layer at explicit start offsets (by full prefill or by the recompute
runner's assembled cache). Out: views `[:num_tokens]` per layer for attention.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (max(capacity, 1), num_kv_heads, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_tokens = 0  # rows valid in every layer

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    def _grow(self, min_capacity: int) -> None:
        new_capacity = max(min_capacity, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_empty((new_capacity, *old.shape[1:]))
                new[: old.shape[0]] = old
                store[i] = new

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
