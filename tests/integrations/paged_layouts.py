"""vLLM's paged KV caches as its allocator lays them out, and read back as its backends read them,
for the connector's writer tests (`test_paged_kv`, `test_connector_worker`). Free of vLLM:
`LAYOUTS` transcribes vLLM 0.32's `KVCacheLayout`, and `make test-vllm` checks the transcription
against vLLM's own enum.

`allocate` makes, like vLLM's `create_kv_cache_views`, one flat buffer viewed as a 5D logical
[layer, block, head, token, content] tensor whose strides follow the layout's physical order, and
hands one 4D view per layer. The readers never use those views: they compute each element's offset
in the flat buffer from the layout's physical order, then read K and V as the backend's kernels do
(flash backends: content = K | V; CPU: each (block, head) page is N K rows, then N V rows).
"""
from __future__ import annotations

import torch

from cachesmith.integrations.paged_kv import CPU_LAYOUT, PagedCache

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
BACKENDS = {"FLASH_ATTN": tuple(LAYOUTS), "FLASHINFER": tuple(LAYOUTS), "TRITON_ATTN": tuple(LAYOUTS),
            "CPU_ATTN": ("LBHNC",)}  # the CPU backend's only supported layout


def strides(order: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    """Element strides of the logical dims when memory runs in `order` (outermost first)."""
    out, step = [0] * len(shape), 1
    for dim in reversed(order):
        out[dim] = step
        step *= shape[dim]
    return out


class Pool:
    """One flat buffer holding every layer's cache in one layout."""

    def __init__(self, layout: str, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype=torch.float32, device="cpu") -> None:
        self.order = LAYOUTS[layout]
        self.shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)
        self.strides = strides(self.order, self.shape)
        self.flat = torch.zeros(num_layers * num_blocks * num_kv_heads * block_size * 2 * head_dim,
                                dtype=dtype, device=device)
        self.head_dim = head_dim

    def views(self) -> list[torch.Tensor]:
        """vLLM's per-layer views [num_blocks, num_kv_heads, block_size, 2 * head_dim]."""
        view_5d = torch.as_strided(self.flat, self.shape, self.strides)
        return list(view_5d.unbind(0))

    def caches(self, backend: str, num_kv_heads: int) -> list[PagedCache]:
        return [PagedCache(i, backend, view, num_kv_heads, self.head_dim, isa="vec")
                for i, view in enumerate(self.views())]

    def read(self, layout_kind: str, layer: int, block_table: list[int], num_rows: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_rows, num_kv_heads, head_dim] of a sequence's first rows, gathered by its block
        table as the backend's attention reads them, from the flat buffer's offsets."""
        _, _, num_heads, block_size, _ = self.shape
        s_layer, s_block, s_head, s_token, s_content = self.strides
        t = torch.arange(num_rows)[:, None, None]  # [rows, 1, 1]
        h = torch.arange(num_heads)[None, :, None]  # [1, H, 1]
        d = torch.arange(self.head_dim)[None, None, :]  # [1, 1, D]
        blocks = torch.tensor(block_table)[t // block_size]
        page = layer * s_layer + blocks * s_block + h * s_head  # where (block, head) starts
        if layout_kind == CPU_LAYOUT:  # the page is [2N, D] in memory: N K rows, then N V rows
            assert self.order == LAYOUTS["LBHNC"]
            key_at = page + (t % block_size) * self.head_dim + d
            value_at = page + (block_size + t % block_size) * self.head_dim + d
        else:  # content = K (head_dim) | V (head_dim)
            key_at = page + (t % block_size) * s_token + d * s_content
            value_at = key_at + self.head_dim * s_content
        flat = self.flat.cpu()
        return flat[key_at], flat[value_at]
