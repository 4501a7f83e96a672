"""The transfer engine: loads stored chunk KV into staging buffers, layer by layer, ahead of the runner.

In: `StoredPrompt`s (prefix and chunk keys, suffix ids), each with room to reserve for its decode,
and the batch's `(S, w, p, r)` plan.
Out: `RecomputeRequest`s whose prefix and chunk tensors are views of the request's own KV cache (the
one decoding will use): stored rows land there, pre-RoPE, and the runner rotates them in place. On
CPU they land directly; on a device through pinned host buffers and a side stream
(`kvstore.staging`). And a `BatchTransfer` hook the runner calls: `before_layer` blocks until that
layer's KV has been read (the stall) and orders the runner's stream after its copies,
`after_selection` turns the selection into row loads.

Transfer plan (paper §5.3): a WarmUp layer loads nothing; a Probe layer (and kv_dev's scoring layer)
loads its full KV; a Patch layer loads only the rows it reuses, known once the selection is. The
prefix is loaded whole wherever cached KV is read. Loads run on the engine's long-lived worker
threads in deadline (layer) order, one task per (layer, request), through a token-bucket link that
emulates a capped bandwidth. Which rows are loaded or issued is one boolean matrix per request
[layer, cached row] (numpy), so the runner's thread does no per-chunk bookkeeping. With prefetch
off, a layer's loads are issued only when the runner reaches it. The selection is on the host on
every device (the runner reads the ranking back once, `signals.rank`, and selects there), so a Patch
layer loads only the rows it reuses on a GPU too, with no sync to learn which.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cachesmith.errors import ConfigError
from cachesmith.kvstore.entry_format import BLOCK_ROWS, CorruptEntry
from cachesmith.kvstore.link import Link
from cachesmith.kvstore.prompt import StoredEntry, StoredPrompt
from cachesmith.kvstore.reader import EntryReader
from cachesmith.kvstore.staging import LayerLoad, StagingPath
from cachesmith.kvstore.store import ChunkStore
from cachesmith.model import ChunkKV, Decoder, KVCache, prefill_chunk
from cachesmith.recompute import RecomputeConfig, RecomputeRequest, RunnerHooks, Signal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferConfig:
    bandwidth_gbps: float | None = None  # None: as fast as the store reads
    num_workers: int = 2
    is_prefetch: bool = True
    ema_alpha: float = 0.3
    is_staged: bool | None = None  # read through host buffers; None: only for a cache off the CPU

    def __post_init__(self) -> None:
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ConfigError(f"bandwidth_gbps={self.bandwidth_gbps} must be positive (or None)")
        if not 1 <= self.num_workers <= 32:
            raise ConfigError(f"num_workers={self.num_workers} must be in [1, 32]")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"ema_alpha={self.ema_alpha} must be in (0, 1]")


@dataclass
class TransferStats:
    bytes_loaded: int = 0
    num_loads: int = 0
    stall_s: float = 0.0
    num_recomputed: int = 0
    effective_gbps: float | None = None  # moving average over loads, for the planner


def layer_needs(plan: RecomputeConfig, num_layers: int) -> tuple[set[int], range]:
    """(layers whose full KV is read before selection, Patch layers that read reused rows)."""
    w, p = plan.warmup, plan.probe
    if w >= num_layers:
        return set(), range(0)
    if plan.signal is Signal.KV_DEV:  # probe layers + the scoring layer w+p read every row
        return set(range(w, min(w + p + 1, num_layers))), range(min(w + p + 1, num_layers), num_layers)
    if plan.signal is Signal.QCI:
        return set(range(w, w + p)), range(w, num_layers)
    if plan.signal is Signal.QCI_LAST:
        return {num_layers - 1}, range(w, num_layers)
    if plan.signal is Signal.FUSED:  # the query's last layer, and layer w scored like kv_dev's
        return {w, num_layers - 1}, range(w + 1, num_layers)
    return set(), range(w, num_layers)


class TransferEngine:
    """Long-lived: holds the link, the bandwidth estimate and the loader threads across batches."""

    def __init__(self, store: ChunkStore, model: Decoder, config: TransferConfig | None = None) -> None:
        self.store, self.model = store, model
        self.config = config or TransferConfig()
        self.link = Link(self.config.bandwidth_gbps)
        self.staging = StagingPath(model.device, self.config.is_staged)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers: list[threading.Thread] = []  # changed in place: the finalizer holds this list
        # an engine dropped without `close` (a discarded pipeline) must not live on in its loader
        # threads: they hold the queue only, and this stops them once the engine is collected
        weakref.finalize(self, _stop_loaders, self._queue, self._workers, self._order)

    def record_load(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.stats.bytes_loaded += nbytes
            self.stats.num_loads += 1
            if seconds > 0 and nbytes:
                gbps, a = nbytes / seconds / 1e9, self.config.ema_alpha
                prev = self.stats.effective_gbps
                self.stats.effective_gbps = gbps if prev is None else (1 - a) * prev + a * gbps

    def stage(self, prompts: Sequence[StoredPrompt], plan: RecomputeConfig,
              extra_capacity: Sequence[int] = ()) -> "BatchTransfer":
        """Stage `prompts` for `plan`, each request's cache with room for `extra_capacity[i]` more
        rows (its decode; default none)."""
        return BatchTransfer(self, prompts, plan, extra_capacity)

    def submit(self, layer: int, batch: "BatchTransfer", request: int, rows: np.ndarray) -> None:
        """Queue one load in deadline order; the workers start on first use and live on."""
        with self._lock:
            if not self._workers:
                self._workers.extend(threading.Thread(target=_load_loop, args=(self._queue,), daemon=True,
                                                      name=f"kv-loader-{i}") for i in range(self.config.num_workers))
                for t in self._workers:
                    t.start()
        self._queue.put((layer, next(self._order), batch, request, rows))

    def close(self) -> None:
        """Stop the loader threads (a closed engine starts new ones if used again)."""
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
        _stop_loaders(self._queue, workers, self._order)
        for t in workers:
            t.join()


def _load_loop(jobs: queue.PriorityQueue) -> None:
    """A loader thread's life. It holds the queue, never the engine: between jobs nothing it
    references keeps the engine (and its model's weights) alive. Under inference mode, as the
    runner is (a new thread starts without it): a cache's pooled slabs may have been made under it,
    and torch refuses in-place writes into such a tensor outside it."""
    with torch.inference_mode():
        while _run_job(jobs.get()):
            pass


def _run_job(job: tuple) -> bool:
    """One queued load (its batch is referenced only while it runs); False for the stop sentinel."""
    layer, _, batch, request, rows = job
    if batch is None:
        return False
    batch.run_load(layer, request, rows)
    return True


def _stop_loaders(jobs: queue.PriorityQueue, workers: list[threading.Thread], order) -> None:
    for _ in workers:
        jobs.put((-1, next(order), None, -1, None))


@dataclass
class _Segment:
    reader: EntryReader | None
    chunk: ChunkKV  # views of the request's cache rows [start, end) in every layer
    is_prefix: bool
    start: int  # first row in the request (its assembled position)
    failed: bool = False

    @property
    def end(self) -> int:
        return self.start + self.chunk.num_tokens


@dataclass
class _Staged:
    """One request's cache, its segments, and which cached rows are loaded or issued per layer."""
    cache: KVCache
    segments: list[_Segment]
    have: np.ndarray  # [num_layers, num_cached_rows] bool
    num_prefix: int

    @property
    def num_cached(self) -> int:
        return self.have.shape[1]


class BatchTransfer(RunnerHooks):
    def __init__(self, engine: TransferEngine, prompts: Sequence[StoredPrompt], plan: RecomputeConfig,
                 extra_capacity: Sequence[int] = ()) -> None:
        self.engine, self.model = engine, engine.model
        self.num_layers = self.model.num_layers
        self._cond = threading.Condition()
        self._pending = [0] * self.num_layers
        self._deferred: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._error: BaseException | None = None
        self._is_closed = False
        self.stall_s = 0.0
        self._last_patched = -1  # Patch layers up to here have run: later selections skip them
        self._max_layer = -1  # the deepest layer the runner has reached
        self.staged: list[_Staged] = []
        try:
            extra = list(extra_capacity) or [0] * len(prompts)
            self.requests = [self._stage_request(i, p, n)
                             for i, (p, n) in enumerate(zip(prompts, extra, strict=True))]
        except BaseException:
            self._close_readers()
            raise
        self.copies = engine.staging.batch()  # after the caches' slabs are taken: copies wait for their last use
        self.set_plan(plan)

    def set_plan(self, plan: RecomputeConfig) -> None:
        """Issue what `plan` reads before selection. Called again when the plan is decided after
        layer 0 (the runner's `replan`): loads already issued are not repeated."""
        full_layers, self.patch_layers = layer_needs(plan, self.num_layers)
        reads_cache = range(plan.warmup, self.num_layers) if plan.warmup < self.num_layers else range(0)
        for layer in sorted(full_layers | set(reads_cache)):
            for i, st in enumerate(self.staged):
                want = np.zeros(st.num_cached, dtype=bool)
                want[: st.num_cached if layer in full_layers else st.num_prefix] = True
                self._need(layer, i, want)

    # -- staging -----------------------------------------------------------------------------
    def _open(self, entry: StoredEntry, field_name: str) -> EntryReader:
        store = self.engine.store
        keyed = None if entry.token_ids is None else (entry.namespace, entry.token_ids)  # one hash a request
        reader = store.open(entry.key, self.model, keyed)
        if reader is None and entry.token_ids is not None:
            log.warning("%s: chunk %s left every store tier after its request was admitted; prefilled again",
                        field_name, entry.key[:12])
            store.ensure(self.model, entry.token_ids, entry.namespace, entry.key)
            self.engine.stats.num_recomputed += 1
            reader = store.open(entry.key, self.model, keyed)
        if reader is None:
            raise CorruptEntry(f"{field_name}: chunk {entry.key[:12]} is not in the store (or was corrupt)")
        return reader

    def _open_all(self, index: int, prompt: StoredPrompt) -> list[tuple[bool, EntryReader]]:
        readers: list[tuple[bool, EntryReader]] = []
        try:
            for name, entry in prompt.entries():
                readers.append((name == "prefix", self._open(entry, f"requests[{index}].{name}")))
        except BaseException:
            for _, r in readers:
                r.close()
            raise
        return readers

    def _stage_request(self, index: int, prompt: StoredPrompt, extra_capacity: int) -> RecomputeRequest:
        """Open every entry, then give the request its cache: each entry's rows are a view of it."""
        readers = self._open_all(index, prompt)
        num_cached = sum(r.header.num_tokens for _, r in readers)
        cache = self.model.new_cache(num_cached + len(prompt.suffix_ids) + extra_capacity)
        segs, start = [], 0
        for is_prefix, reader in readers:
            h = reader.header
            keys, values = cache.rows(start, start + h.num_tokens)  # [L, T, Hkv, D]
            segs.append(_Segment(reader, ChunkKV(h.token_ids, keys, values, h.model_fingerprint), is_prefix, start))
            start += h.num_tokens
        num_prefix = segs[0].chunk.num_tokens if segs and segs[0].is_prefix else 0
        self.staged.append(_Staged(cache, segs, np.zeros((self.num_layers, num_cached), dtype=bool), num_prefix))
        chunks = [s.chunk for s in segs if not s.is_prefix]
        prefix = segs[0].chunk if num_prefix else None
        return RecomputeRequest(chunks, list(prompt.suffix_ids), prefix, extra_capacity=extra_capacity, cache=cache)

    # -- issuing -----------------------------------------------------------------------------
    def _need(self, layer: int, request: int, want: np.ndarray) -> None:
        """Mark cached rows `want` [num_cached] of `layer` as needed; issue now (prefetch) or at
        before_layer."""
        have = self.staged[request].have[layer]
        new = want & ~have
        if not new.any():
            return
        have |= new
        if self.engine.config.is_prefetch:
            self._issue(layer, request, new)
        else:
            self._deferred.setdefault(layer, []).append((request, new))

    def _issue(self, layer: int, request: int, rows: np.ndarray) -> None:
        with self._cond:
            self._pending[layer] += 1
        self.engine.submit(layer, self, request, rows)

    def run_load(self, layer: int, request: int, rows: np.ndarray) -> None:
        """On a loader thread: the cached rows `rows` [num_cached] of one request's `layer`, every
        entry's into one host buffer sent on in one copy (`staging.LayerLoad`)."""
        try:
            if not self._is_closed:
                st = self.staged[request]
                keys, values = st.cache.keys[layer][:st.num_cached], st.cache.values[layer][:st.num_cached]
                with self.copies.layer_load(layer, keys, values) as load:
                    for seg in st.segments:
                        wanted = rows[seg.start:seg.end]
                        if not seg.failed and seg.reader is not None and wanted.any():
                            self._load_segment(load, seg, wanted)
        except BaseException as exc:  # surfaced to the runner in before_layer
            self._error = exc
        finally:
            with self._cond:
                self._pending[layer] -= 1
                self._cond.notify_all()

    def _load_segment(self, load: LayerLoad, seg: _Segment, wanted: np.ndarray) -> None:
        num_rows = int(wanted.sum())
        on_link = self.engine.link.consume(seg.reader.header.rows_bytes(num_rows))
        blocks = None if num_rows == wanted.size else np.unique(wanted.nonzero()[0] // BLOCK_ROWS).tolist()
        try:
            nbytes = load.read(seg.reader, seg.start, blocks)
        except CorruptEntry as exc:
            log.warning("transfer: %s; the chunk will be recomputed", exc)
            seg.failed = True
            return
        self.engine.record_load(nbytes, time.monotonic() - on_link)

    # -- runner hooks ------------------------------------------------------------------------
    def after_selection(self, selected: list[torch.Tensor]) -> None:
        layers = [layer for layer in self.patch_layers if layer > self._last_patched]
        for i, (st, sel) in enumerate(zip(self.staged, selected)):
            reused = np.ones(st.num_cached, dtype=bool)  # the prefix (exact) is read with them
            reused[st.num_prefix + sel.numpy()] = False  # a host tensor on every device (`signals.select`)
            for layer in layers:
                self._need(layer, i, reused)

    def before_layer(self, layer: int, phase: str) -> None:
        start = time.perf_counter()
        if phase == "patch":
            self._last_patched = layer
        for request, rows in self._deferred.pop(layer, []):
            self._issue(layer, request, rows)
        with self._cond:
            self._cond.wait_for(lambda: self._pending[layer] == 0 or self._error is not None)
        if self._error is not None:
            raise self._error
        self.copies.wait_layer(layer)
        first_unread = layer if layer > self._max_layer else self._max_layer + 1
        self._max_layer = max(self._max_layer, layer)
        self._recompute_failed(first_unread)
        self.stall_s += time.perf_counter() - start

    def _recompute_failed(self, first_layer: int) -> None:
        failed = [seg for st in self.staged for seg in st.segments if seg.failed and seg.reader is not None]
        if failed:  # let in-flight loads land first, so none writes over the recomputed rows
            with self._cond:
                self._cond.wait_for(lambda: sum(self._pending) == 0)
            self.copies.wait_all()
        for seg in failed:
            self._replace(seg, first_layer)

    def _replace(self, seg: _Segment, first_layer: int) -> None:
        """A corrupt entry: recompute the chunk into the layers the runner has not read yet (the
        earlier ones already hold what it computed), evict it and store it anew."""
        key, namespace = seg.reader.header.key, seg.reader.header.namespace
        fresh = prefill_chunk(self.model, list(seg.chunk.token_ids))
        seg.chunk.keys[first_layer:].copy_(fresh.keys[first_layer:])
        seg.chunk.values[first_layer:].copy_(fresh.values[first_layer:])
        for st in self.staged:
            if any(s is seg for s in st.segments):
                st.have[:, seg.start:seg.end] = True
        seg.reader.close()
        seg.reader = None
        self.engine.store.delete(key)
        self.engine.store.put(fresh, namespace)
        self.engine.stats.num_recomputed += 1

    def close(self) -> None:
        """Skip what is still queued and wait for the loads in flight: none may land in a cache
        once its batch is done (the cache goes on to decoding, or back to the pool)."""
        self._is_closed = True
        with self._cond:
            self._cond.wait_for(lambda: sum(self._pending) == 0)
        self.copies.wait_all()
        self._close_readers()
        self.engine.stats.stall_s += self.stall_s

    def _close_readers(self) -> None:
        for st in self.staged:
            for seg in st.segments:
                if seg.reader is not None:
                    seg.reader.close()
                    seg.reader = None

    def __enter__(self) -> "BatchTransfer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
