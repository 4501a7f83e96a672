"""vLLM's paged KV caches as its allocator lays them out, and read back as its backends read them,
for the connector's writer tests (`test_paged_kv`, `test_connector_worker`). Free of vLLM:
`LAYOUTS` transcribes vLLM 0.32's `KVCacheLayout`, and `make test-vllm` checks the transcription
against vLLM's own enum.

`allocate` makes, like vLLM's `create_kv_cache_views`, one flat buffer viewed as a 5D logical
[layer, block, head, token, content] tensor whose strides follow the layout's physical order, and
hands one 4D view per layer. The reader never uses those views: it computes each element's offset
in the flat buffer from the layout's physical order, then reads K and V as the flash backends'
kernels do (content = K | V). A CPU cache's pages are laid out by vLLM's CPU kernels per
instruction set; only vLLM's op writes them, and `make test-vllm` checks its answers.
"""
from __future__ import annotations

import torch

from cachesmith.integrations.paged_kv import PagedCache

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
FLASH_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")  # each takes every layout


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

    def read(self, layer: int, block_table: list[int], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_rows, num_kv_heads, head_dim] of a sequence's first rows, gathered by its block
        table as a flash backend's attention reads them, from the flat buffer's offsets."""
        _, _, num_heads, block_size, _ = self.shape
        s_layer, s_block, s_head, s_token, s_content = self.strides
        t = torch.arange(num_rows)[:, None, None]  # [rows, 1, 1]
        h = torch.arange(num_heads)[None, :, None]  # [1, H, 1]
        d = torch.arange(self.head_dim)[None, None, :]  # [1, 1, D]
        blocks = torch.tensor(block_table)[t // block_size]
        page = layer * s_layer + blocks * s_block + h * s_head  # where (block, head) starts
        key_at = page + (t % block_size) * s_token + d * s_content  # content = K (head_dim) | V (head_dim)
        value_at = key_at + self.head_dim * s_content
        flat = self.flat.cpu()
        return flat[key_at], flat[value_at]
