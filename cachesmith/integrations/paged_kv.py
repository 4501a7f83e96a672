"""Writes a prompt's KV rows into vLLM's paged KV caches, for each attention backend that holds them.

In: one `PagedCache` per decoder layer (vLLM's per-layer view of its cache, the backend's name, the
layer's KV heads and head size), rows of K and V [num_rows, num_kv_heads, head_dim] and the slots
vLLM allocated them (block id * block size + offset, int64 on the cache's device). Out: the rows in
the cache, where that backend's attention reads them. Free of vLLM: its cache ops come in as
`VllmOps`, so `make test` covers every layout with index writes on the CPU and the simulated device.

vLLM (0.32) hands each layer's cache as one logical view [num_blocks, num_kv_heads, block_size,
2 * head_dim] whatever its physical layout (`KVCacheLayout`, a stride permutation of [layer, block,
head, token, content] that the view's strides carry). The backends read that view two ways:
- FLASH_ATTN, FLASHINFER, TRITON_ATTN: K is the first head_dim of the last axis, V the second
  (`kv_cache.transpose(1, 2).split(head_size, -1)`: [num_blocks, block_size, num_kv_heads, head_dim]);
- CPU_ATTN: each (block, head) page is split in a K half and a V half
  (`kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)`), laid out inside by the kernels of the CPU's
  instruction set (with `vec16`, K is stored transposed, [D, N]).
A flash cache is written by vLLM's `reshape_and_cache_flash` where the build has it (CUDA builds),
else by one index write per K and V by slot, which honours any stride order. A CPU cache is
written by vLLM's `cpu_attn_reshape_and_cache` only (every CPU build has it): its layout inside a
page is the kernels' own. The block size is the cache's own (vLLM may split a scheduler block into
kernel blocks: slot // block_size still names the kernel block). Quantized caches (fp8, int8,
nvfp4) are refused: the rows are in the model's dtype and nothing here converts them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

FLASH_LAYOUT = "flash"  # K | V along the last axis of [B, H, N, 2D]
CPU_LAYOUT = "cpu"  # each (block, head) page: a K half, then a V half, each in the kernels' layout
BACKEND_LAYOUTS = {"FLASH_ATTN": FLASH_LAYOUT, "FLASHINFER": FLASH_LAYOUT, "TRITON_ATTN": FLASH_LAYOUT,
                   "CPU_ATTN": CPU_LAYOUT}
UNQUANTIZED_KV = ("auto", "float16", "bfloat16", "float32", "half", "float")  # vLLM's kv_cache_dtype names
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (key, value, slots)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Refuses a quantized KV cache by name: the connector writes the model's dtype and does not convert."""
    if str(kv_cache_dtype) not in UNQUANTIZED_KV:
        raise ValueError(f"CachesmithConnector: kv_cache_dtype={kv_cache_dtype!r}: the connector writes K/V in the "
                         "model's dtype and does not quantize them; launch vLLM with --kv-cache-dtype auto")


class VllmOps(NamedTuple):
    """vLLM's cache-write ops, where its build has them (None: an index write instead)."""
    reshape_and_cache_flash: Callable | None = None  # (key, value, k_cache, v_cache, slots, dtype, k_scale, v_scale)
    cpu_attn_reshape_and_cache: Callable | None = None  # (key, value, k_cache, v_cache, slots, isa)


@dataclass(frozen=True)
class PagedCache:
    """One layer's cache as vLLM registered it."""
    layer_index: int  # the decoder layer whose K/V it holds
    backend: str  # vLLM's attention backend name (`AttentionBackend.get_name()`)
    kv_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, 2 * head_dim], any stride order
    num_kv_heads: int
    head_dim: int
    isa: str = ""  # the CPU backend's kernel set (`layer.isa`)

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    @property
    def layout(self) -> str:
        return BACKEND_LAYOUTS[self.backend]

    def check(self) -> None:
        """A clear error naming the layer when the connector cannot write this cache."""
        where = f"CachesmithConnector: layer {self.layer_index}"
        if self.backend not in BACKEND_LAYOUTS:
            raise ValueError(f"{where}: attention backend {self.backend}: the connector writes "
                             f"{', '.join(BACKEND_LAYOUTS)} caches only (choose one with --attention-backend)")
        expected = (self.num_kv_heads, 2 * self.head_dim)
        if self.kv_cache.dim() != 4 or (self.kv_cache.shape[1], self.kv_cache.shape[3]) != expected:
            raise ValueError(f"{where}: cache of shape {tuple(self.kv_cache.shape)}, expected [num_blocks, "
                             f"{self.num_kv_heads}, block_size, {2 * self.head_dim}] ({self.backend})")
        if self.backend == "CPU_ATTN" and not self.isa:
            raise ValueError(f"{where}: the CPU backend named no kernel set (layer.isa) for its cache")
        if not self.kv_cache.dtype.is_floating_point or self.kv_cache.element_size() < 2:
            raise ValueError(f"{where}: cache dtype {self.kv_cache.dtype} is quantized; the connector writes "
                             "the model's dtype (launch vLLM with --kv-cache-dtype auto)")

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as the backend's cache op takes them: flash [B, N, H, D] each; CPU two halves
        [B, H, N, D] of each page (what a row of the CPU halves holds is the kernels' affair)."""
        kv = self.kv_cache
        if self.layout == FLASH_LAYOUT:
            return kv.transpose(1, 2).split(self.head_dim, dim=-1)
        num_blocks, num_heads, block_size, _ = kv.shape
        return kv.view(num_blocks, num_heads, 2 * block_size, self.head_dim).chunk(2, dim=2)


def index_write(cache: PagedCache) -> Writer:
    """One index write per K and V by slot: any stride order, any device, no vLLM op needed (flash
    layouts only: a CPU page's inside is its kernels')."""
    if cache.layout == CPU_LAYOUT:
        raise ValueError(f"CachesmithConnector: layer {cache.layer_index}: a CPU_ATTN cache is written by vLLM's "
                         "cpu_attn_reshape_and_cache only (its kernels lay a page out per instruction set), "
                         "which this vLLM build lacks")
    key_view, value_view = cache.views()

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        # key, value: [num_rows, num_kv_heads, head_dim]; slots: [num_rows]
        blocks, offsets = slots // cache.block_size, slots % cache.block_size
        key_view[blocks, offsets] = key
        value_view[blocks, offsets] = value
    return write


def op_write(cache: PagedCache, ops: VllmOps) -> Writer | None:
    """vLLM's own cache op for this cache, where the build has one that runs on its device."""
    key_view, value_view = cache.views()
    on_cuda = cache.kv_cache.device.type == "cuda"
    if cache.layout == FLASH_LAYOUT and on_cuda and ops.reshape_and_cache_flash is not None:
        scale = torch.ones((), dtype=torch.float32, device=cache.kv_cache.device)  # unquantized: unused

        def flash(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            ops.reshape_and_cache_flash(key.contiguous(), value.contiguous(), key_view, value_view, slots, "auto", scale, scale)
        return flash
    if cache.layout == CPU_LAYOUT and not on_cuda and ops.cpu_attn_reshape_and_cache is not None:
        def cpu(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_view, value_view, slots,
                                           cache.isa)
        return cpu
    return None


def writer_for(cache: PagedCache, ops: VllmOps) -> tuple[str, Writer]:
    """(the writer's name, for the log; the writer) of one checked cache."""
    cache.check()
    op = op_write(cache, ops)
    if op is not None:
        name = "reshape_and_cache_flash" if cache.layout == FLASH_LAYOUT else "cpu_attn_reshape_and_cache"
        return name, op
    return "index write by slot", index_write(cache)


def describe_writers(names: dict[int, str], backends: dict[int, str]) -> str:
    """One line per run of consecutive layers with one writer: `layers 0-29: <writer> (<backend>)`."""
    runs: list[list] = []
    for i in sorted(names):
        what = (names[i], backends[i])
        if runs and runs[-1][2] == what and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, what])
    return "; ".join(f"layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {w} ({be})"
                     for a, b, (w, be) in runs)
