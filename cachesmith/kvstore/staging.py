"""Where stored KV bytes land on their way into a request's KV cache.

In: an `EntryReader`, a layer, the destination rows of that layer (views of the request's cache,
`[num_tokens, num_kv_heads, head_dim]`) and which 64-row blocks to read. Out: the destination
filled, and the bytes read. Checksums are always verified on host bytes, before anything reaches
the destination.

Two routes, chosen by where the cache lives:
- **direct** (a CPU cache): the reader fills the cache rows themselves; the cache's memory is the
  staging buffer, so no byte is copied twice.
- **staged** (a device cache, or on request on CPU so that CPU CI walks the same code): the reader
  fills a host buffer (pinned on CUDA, so the copy can be asynchronous), and the verified rows are
  copied to the destination. On CUDA the copy runs on a side stream and records an event per load;
  the runner's stream waits for a layer's events just before that layer reads cached KV
  (`wait_layer`), so loads of later layers overlap compute and no call blocks the host on the
  device. The paper's layer-wise prefetch; LMCache's layer-wise GPU connector works the same way.

A device cache never has `.numpy()` called on it: a host view of device memory does not exist.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

from cachesmith.kvstore.entry_format import BLOCK_ROWS
from cachesmith.kvstore.reader import EntryReader, block_runs
from cachesmith.model import device as accel


def is_staged_for(device: torch.device, is_staged: bool | None) -> bool:
    """The route for a cache on `device`: staged off the CPU always, on the CPU when asked."""
    return device.type != "cpu" or bool(is_staged)


class StagingPath:
    """Long-lived, one per transfer engine: the route and, on CUDA, the side stream copies run on."""

    def __init__(self, device: torch.device, is_staged: bool | None = None) -> None:
        self.device = torch.device(device)
        self.is_staged = is_staged_for(self.device, is_staged)
        self.is_async = self.device.type == "cuda"
        self.stream = accel.new_stream(self.device)

    def batch(self) -> "BatchStaging":
        """The copies of one batch; call on the thread that runs the batch's layers, after its
        caches are taken (see `BatchStaging`)."""
        return BatchStaging(self)


class BatchStaging:
    """One batch's loads: called from loader threads (`load`) and the runner's thread (the rest).
    Made once the batch's caches are: their slabs may come from the pool, last used by work still
    queued on the compute stream (by any thread), and side-stream copies must not overtake it."""

    def __init__(self, path: StagingPath) -> None:
        self.path = path
        self._events: dict[int, list] = defaultdict(list)  # layer -> device events of its copies
        self._lock = threading.Lock()
        if path.is_async:
            path.stream.wait_stream(accel.current_stream(path.device))

    def load(self, reader: EntryReader, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor,
             blocks: list[int] | None) -> int:
        """Fill the rows of `blocks` (None: all) of k_dst/v_dst [T, Hkv, D]; bytes read."""
        if not self.path.is_staged:
            return reader.read_blocks_into(layer, k_dst, v_dst, blocks)
        is_pinned = self.path.is_async
        k_host = accel.pinned_empty(k_dst.shape, k_dst.dtype, is_pinned)  # [T, Hkv, D]
        v_host = accel.pinned_empty(v_dst.shape, v_dst.dtype, is_pinned)
        nbytes = reader.read_blocks_into(layer, k_host, v_host, blocks)  # verified here, on the host
        num_blocks = -(-k_dst.shape[0] // BLOCK_ROWS)
        runs = [(0, num_blocks)] if blocks is None else block_runs(blocks)
        self._copy(layer, runs, (k_dst, v_dst), (k_host, v_host))
        return nbytes

    def _copy(self, layer: int, runs: list[tuple[int, int]], dsts: tuple[torch.Tensor, ...],
              srcs: tuple[torch.Tensor, ...]) -> None:
        """Verified host rows of each block run into the destination; rows outside the runs are
        left alone (an earlier load of this layer may have filled them). On CUDA the pinned source
        stays alive until its copy has run: torch's host allocator holds the block back until then."""
        is_async = self.path.is_async
        with accel.on_stream(self.path.stream):
            for first, end in runs:
                rows = slice(first * BLOCK_ROWS, end * BLOCK_ROWS)
                for dst, src in zip(dsts, srcs):
                    dst[rows].copy_(src[rows], non_blocking=is_async)
            if not is_async:
                return
            for dst in dsts:  # a slab freed (not pooled) mid-copy is reused only after the copy
                accel.record_stream(dst, self.path.stream)
            event = accel.new_event(self.path.device)
            event.record(self.path.stream)
        with self._lock:
            self._events[layer].append(event)

    def wait_layer(self, layer: int) -> None:
        """Order the runner's stream after every copy issued so far into `layer` (no host sync)."""
        with self._lock:
            events = self._events.pop(layer, [])
        if events:
            stream = accel.current_stream(self.path.device)
            for event in events:
                stream.wait_event(event)

    def wait_all(self) -> None:
        """Order the runner's stream after every copy issued so far, into any layer: before the
        cache is written outside the layer order (a corrupt chunk recomputed) or handed on."""
        with self._lock:
            layers = list(self._events)
        for layer in layers:
            self.wait_layer(layer)
