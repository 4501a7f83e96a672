"""Where stored KV bytes land on their way into a request's KV cache.

In: a layer, the destination rows of that layer (views of the request's cache,
`[num_cached, num_kv_heads, head_dim]`), and per stored entry its `EntryReader`, where its rows
start and which 64-row blocks to read (`LayerLoad`). Out: the destination filled, and the bytes read. Checksums are always verified on host bytes, before anything reaches
the destination.

Two routes, chosen by where the cache lives:
- **direct** (a CPU cache): the reader fills the cache rows themselves; the cache's memory is the
  staging buffer, so no byte is copied twice.
- **staged** (a device cache, or on request on CPU so that CPU CI walks the same code): every entry
  of the request is read into one host buffer (pinned on CUDA, so the copy can be asynchronous), and
  the verified rows go to the destination in one copy per tensor. On CUDA the copy runs on a side stream and records an event per load;
  the runner's stream waits for a layer's events just before that layer reads cached KV
  (`wait_layer`), so loads of later layers overlap compute and no call blocks the host on the
  device. The paper's layer-wise prefetch; LMCache's layer-wise GPU connector works the same way.
  An encoded entry (`kvstore.codec`) bound for a device keeps its stored bytes: they are copied
  as they are (the smaller bytes cross the link) and decoded on the device, on the same stream.

A device cache never has `.numpy()` called on it: a host view of device memory does not exist.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import NamedTuple

import torch

from cachesmith.kvstore import codec as kv_codec
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
        with self.layer_load(layer, k_dst, v_dst) as load:
            return load.read(reader, 0, blocks)

    def layer_load(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> "LayerLoad":
        """One request's loads into one layer's rows k_dst/v_dst [num_cached, Hkv, D]: every entry
        read into one host buffer, and copied on once (`LayerLoad`)."""
        return LayerLoad(self, layer, k_dst, v_dst)

    def _copy(self, layer: int, runs: list[tuple[int, int]], dsts: tuple[torch.Tensor, ...],
              srcs: tuple[torch.Tensor, ...]) -> None:
        """Verified host rows [a, b) of each run into the destination; rows outside the runs are
        left alone (an earlier load of this layer may have filled them, or the runner). One host ->
        device copy per tensor: of the run, or of the span of several runs into a device scratch
        buffer whose runs are then copied on the device. On CUDA the pinned source stays alive
        until its copy has run: torch's host allocator holds the block back until then."""
        is_async = self.path.is_async
        lo, hi = runs[0][0], runs[-1][1]
        with accel.on_stream(self.path.stream):
            for dst, src in zip(dsts, srcs):
                if len(runs) == 1 or not is_async:
                    for a, b in runs:
                        dst[a:b].copy_(src[a:b], non_blocking=is_async)
                    continue
                # allocated on the side stream: its memory is reused only after this stream's work
                span = torch.empty(src[lo:hi].shape, dtype=src.dtype, device=dst.device)  # [hi - lo, Hkv, D]
                span.copy_(src[lo:hi], non_blocking=True)
                for a, b in runs:
                    dst[a:b].copy_(span[a - lo:b - lo])
            if is_async:
                self._record(layer, dsts)

    def _decode(self, layer: int, encoded: list["_Encoded"], dsts: tuple[torch.Tensor, ...]) -> None:
        """Encoded entries' verified blocks copied to the device as stored (int8: about a quarter
        of float32's bytes) and decoded there, on the side stream, into their destination rows."""
        with accel.on_stream(self.path.stream):
            for item in encoded:
                for is_value, (raw, dst) in enumerate(zip(item.raws, dsts)):
                    on_device = raw.to(self.path.device, non_blocking=True)  # [stored bytes] uint8
                    kv_codec.decode_into(item.codec, on_device, item.first_block, item.num_tokens,
                                         dst[item.rows[0]:item.rows[1]], bool(is_value))
            self._record(layer, dsts)

    def _record(self, layer: int, dsts: tuple[torch.Tensor, ...]) -> None:
        """On the side stream: the event the runner's stream waits for before `layer` reads."""
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


class LayerLoad:
    """One request's stored rows of one layer, entry by entry, then sent on at once: on the direct
    route each entry's reader fills the cache rows; staged, it fills the rows of one host buffer the
    size of the request's cached rows (pinned on CUDA), and `finish` copies every row read to the
    device in one copy per tensor, where one buffer and two copies per entry made a 16K request of
    many chunks cost about 1,400 loads. A corrupt entry raises from `read` before its rows are
    marked, so they never reach the destination."""

    def __init__(self, staging: BatchStaging, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor) -> None:
        self.staging, self.layer = staging, layer
        self.dsts = (k_dst, v_dst)  # [num_cached, Hkv, D] each
        self.is_staged = staging.path.is_staged
        self._srcs = None if self.is_staged else self.dsts
        self.runs: list[tuple[int, int]] = []  # rows read and verified, [a, b) in the request
        self.encoded: list[_Encoded] = []  # encoded entries' blocks, decoded on the device

    @property
    def srcs(self) -> tuple[torch.Tensor, ...]:
        """Where exact entries' rows are read: the destination itself, or, staged, one host buffer
        the size of it (pinned on CUDA), made on first use (a request of encoded entries needs none)."""
        if self._srcs is None:
            is_pinned = self.staging.path.is_async
            self._srcs = tuple(accel.pinned_empty(d.shape, d.dtype, is_pinned) for d in self.dsts)
        return self._srcs

    def read(self, reader: EntryReader, start: int, blocks: list[int] | None) -> int:
        """The blocks (None: all) of one entry whose rows start at `start`; bytes read."""
        num_tokens = reader.header.num_tokens
        if reader.header.codec != "none" and self.staging.path.is_async:
            return self._read_encoded(reader, start, blocks)
        k, v = (t[start:start + num_tokens] for t in self.srcs)  # [T, Hkv, D]
        nbytes = reader.read_blocks_into(self.layer, k, v, blocks)  # verified here, on the host
        runs = [(0, -(-num_tokens // BLOCK_ROWS))] if blocks is None else block_runs(blocks)
        self.runs += [(start + a * BLOCK_ROWS, start + min(b * BLOCK_ROWS, num_tokens)) for a, b in runs]
        return nbytes

    def _read_encoded(self, reader: EntryReader, start: int, blocks: list[int] | None) -> int:
        """An encoded entry bound for a device: its blocks' stored bytes, verified, kept as they are
        for `finish` to copy and decode on the device."""
        h = reader.header
        runs = [(0, -(-h.num_tokens // BLOCK_ROWS))] if blocks is None else block_runs(blocks)
        nbytes = 0
        for a, b in runs:
            raws = reader.read_encoded(self.layer, (a, b), is_pinned=True)
            rows = (start + a * BLOCK_ROWS, start + min(b * BLOCK_ROWS, h.num_tokens))
            self.encoded.append(_Encoded(h.codec, h.num_tokens, a, rows, raws))
            nbytes += sum(raw.numel() for raw in raws)
        return nbytes

    def finish(self) -> None:
        if self.is_staged and self.runs:
            self.staging._copy(self.layer, _merged(self.runs), self.dsts, self.srcs)
        if self.encoded:
            self.staging._decode(self.layer, self.encoded, self.dsts)

    def __enter__(self) -> "LayerLoad":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.finish()


class _Encoded(NamedTuple):
    """One run of an encoded entry's blocks, verified on the host, bound for the device."""
    codec: str
    num_tokens: int  # the entry's rows
    first_block: int
    rows: tuple[int, int]  # [a, b) in the request's cached rows
    raws: tuple[torch.Tensor, ...]  # K's and V's stored bytes, pinned uint8


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [a, b) row runs with touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
