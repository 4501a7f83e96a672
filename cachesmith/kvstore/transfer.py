"""The transfer engine: loads stored chunk KV into staging buffers, layer by layer, ahead of the runner.

In: keyed requests (prefix key, chunk keys, suffix ids) and the batch's `(S, w, p, r)` plan.
Out: `RecomputeRequest`s whose chunk tensors are staging buffers, and a `BatchTransfer` hook the
runner calls: `before_layer` blocks until that layer's KV has arrived (the stall), `after_selection`
turns the selection into row loads.

Transfer plan (paper §5.3): a WarmUp layer loads nothing; a Probe layer (and kv_dev's scoring layer)
loads its full KV; a Patch layer loads only the rows it reuses, known once the selection is. The
prefix is loaded whole wherever cached KV is read. Loads run on worker threads in deadline (layer)
order through a token-bucket link that emulates a capped bandwidth. With prefetch off, a layer's
loads are issued only when the runner reaches it.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from cachesmith.errors import ConfigError
from cachesmith.kvstore.entry_format import CorruptEntry
from cachesmith.kvstore.link import Link
from cachesmith.kvstore.reader import EntryReader
from cachesmith.kvstore.store import ChunkStore
from cachesmith.model import ChunkKV, Decoder, prefill_chunk
from cachesmith.recompute import RecomputeConfig, RecomputeRequest, RunnerHooks, Signal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferConfig:
    bandwidth_gbps: float | None = None  # None: as fast as the store reads
    num_workers: int = 2
    is_prefetch: bool = True
    ema_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ConfigError(f"bandwidth_gbps={self.bandwidth_gbps} must be positive (or None)")
        if not 1 <= self.num_workers <= 32:
            raise ConfigError(f"num_workers={self.num_workers} must be in [1, 32]")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"ema_alpha={self.ema_alpha} must be in (0, 1]")


@dataclass
class KeyedRequest:
    chunk_keys: list[str]
    suffix_ids: list[int]
    prefix_key: str | None = None
    coverage: float | None = None
    extra_capacity: int = 0


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
    return set(), range(w, num_layers)


@dataclass
class _Segment:
    reader: EntryReader
    chunk: ChunkKV  # staging buffers
    is_prefix: bool
    context_start: int  # where its rows start among the request's context rows
    have: list[torch.Tensor] = field(default_factory=list)  # [layer] bool [T]: loaded or issued
    failed: bool = False


class TransferEngine:
    """Long-lived: holds the link and the bandwidth estimate across batches."""

    def __init__(self, store: ChunkStore, model: Decoder, config: TransferConfig | None = None) -> None:
        self.store, self.model = store, model
        self.config = config or TransferConfig()
        self.link = Link(self.config.bandwidth_gbps)
        self.stats = TransferStats()
        self._lock = threading.Lock()

    def record_load(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.stats.bytes_loaded += nbytes
            self.stats.num_loads += 1
            if seconds > 0 and nbytes:
                gbps, a = nbytes / seconds / 1e9, self.config.ema_alpha
                prev = self.stats.effective_gbps
                self.stats.effective_gbps = gbps if prev is None else (1 - a) * prev + a * gbps

    def stage(self, requests: list[KeyedRequest], plan: RecomputeConfig) -> "BatchTransfer":
        return BatchTransfer(self, requests, plan)


class BatchTransfer(RunnerHooks):
    def __init__(self, engine: TransferEngine, requests: list[KeyedRequest], plan: RecomputeConfig) -> None:
        self.engine, self.model = engine, engine.model
        self.num_layers = self.model.num_layers
        self.segments: list[list[_Segment]] = []
        self.requests = [self._stage_request(i, r) for i, r in enumerate(requests)]
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._pending = [0] * self.num_layers
        self._deferred: dict[int, list[tuple[_Segment, torch.Tensor | None]]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.stall_s = 0.0
        self._last_patched = -1  # Patch layers up to here have run: later selections skip them
        self._workers = [threading.Thread(target=self._work, daemon=True)
                         for _ in range(engine.config.num_workers)]
        for t in self._workers:
            t.start()
        self.set_plan(plan)

    def set_plan(self, plan: RecomputeConfig) -> None:
        """Issue what `plan` reads before selection. Called again when the plan is decided after
        layer 0 (the runner's `replan`): loads already issued are not repeated."""
        full_layers, self.patch_layers = layer_needs(plan, self.num_layers)
        reads_cache = range(plan.warmup, self.num_layers) if plan.warmup < self.num_layers else range(0)
        for layer in sorted(full_layers | set(reads_cache)):
            for segs in self.segments:
                for seg in segs:
                    if seg.is_prefix or layer in full_layers:
                        self._need(layer, seg, None)

    # -- staging -----------------------------------------------------------------------------
    def _open(self, key: str, field_name: str) -> EntryReader:
        reader = self.engine.store.open(key, self.model)
        if reader is None:
            raise CorruptEntry(f"{field_name}: chunk {key[:12]} is not in the store (or was corrupt)")
        return reader

    def _stage_request(self, index: int, req: KeyedRequest) -> RecomputeRequest:
        segs, start = [], 0
        keys = ([("prefix", req.prefix_key)] if req.prefix_key else []) + \
            [(f"chunks[{j}]", k) for j, k in enumerate(req.chunk_keys)]
        for name, key in keys:
            reader = self._open(key, f"requests[{index}].{name}")
            h = reader.header
            shape = (h.num_layers, h.num_tokens, h.num_kv_heads, h.head_dim)
            chunk = ChunkKV(h.token_ids, torch.empty(shape, dtype=h.torch_dtype),
                            torch.empty(shape, dtype=h.torch_dtype), h.model_fingerprint)
            is_prefix = name == "prefix"
            segs.append(_Segment(reader, chunk, is_prefix, -1 if is_prefix else start,
                                 [torch.zeros(h.num_tokens, dtype=torch.bool) for _ in range(h.num_layers)]))
            start += 0 if is_prefix else h.num_tokens
        self.segments.append(segs)
        chunks = [s.chunk for s in segs if not s.is_prefix]
        prefix = next((s.chunk for s in segs if s.is_prefix), None)
        return RecomputeRequest(chunks, list(req.suffix_ids), prefix, req.coverage, req.extra_capacity)

    # -- issuing -----------------------------------------------------------------------------
    def _need(self, layer: int, seg: _Segment, rows: torch.Tensor | None) -> None:
        """Mark rows (None = all) of `layer` as needed; issue now (prefetch) or at before_layer."""
        have = seg.have[layer]
        rows = (~have).nonzero().flatten() if rows is None else rows[~have[rows]]
        if rows.numel() == 0:
            return
        have[rows] = True
        load_rows = None if rows.numel() == have.numel() else rows
        if self.engine.config.is_prefetch:
            self._issue(layer, seg, load_rows)
        else:
            self._deferred.setdefault(layer, []).append((seg, load_rows))

    def _issue(self, layer: int, seg: _Segment, rows: torch.Tensor | None) -> None:
        with self._cond:
            self._pending[layer] += 1
        self._queue.put((layer, next(self._order), seg, rows))

    def _work(self) -> None:
        while True:
            layer, _, seg, rows = self._queue.get()
            if seg is None:
                return
            try:
                if not seg.failed:
                    self._load(layer, seg, rows)
            except CorruptEntry as exc:
                log.warning("transfer: %s; the chunk will be recomputed", exc)
                seg.failed = True
            except BaseException as exc:  # surfaced to the runner in before_layer
                self._error = exc
            finally:
                with self._cond:
                    self._pending[layer] -= 1
                    self._cond.notify_all()

    def _load(self, layer: int, seg: _Segment, rows: torch.Tensor | None) -> None:
        num_rows = seg.chunk.num_tokens if rows is None else rows.numel()
        on_link = self.engine.link.consume(2 * num_rows * seg.reader.header.row_bytes)
        nbytes = seg.reader.read_layer_into(layer, seg.chunk.keys[layer], seg.chunk.values[layer], rows)
        self.engine.record_load(nbytes, time.monotonic() - on_link)

    # -- runner hooks ------------------------------------------------------------------------
    def after_selection(self, selected: list[torch.Tensor]) -> None:
        for segs, sel in zip(self.segments, selected):
            for seg in segs:
                if seg.is_prefix:
                    continue
                local = sel[(sel >= seg.context_start) & (sel < seg.context_start + seg.chunk.num_tokens)]
                reused = torch.ones(seg.chunk.num_tokens, dtype=torch.bool)
                reused[local - seg.context_start] = False
                rows = reused.nonzero().flatten()
                for layer in self.patch_layers:
                    if layer > self._last_patched:
                        self._need(layer, seg, rows)

    def before_layer(self, layer: int, phase: str) -> None:
        start = time.perf_counter()
        if phase == "patch":
            self._last_patched = layer
        for seg, rows in self._deferred.pop(layer, []):
            self._issue(layer, seg, rows)
        with self._cond:
            self._cond.wait_for(lambda: self._pending[layer] == 0 or self._error is not None)
        if self._error is not None:
            raise self._error
        self._recompute_failed()
        self.stall_s += time.perf_counter() - start

    def _recompute_failed(self) -> None:
        failed = [seg for segs in self.segments for seg in segs if seg.failed and seg.reader is not None]
        if failed:  # let in-flight loads land first, so none writes over the recomputed rows
            with self._cond:
                self._cond.wait_for(lambda: sum(self._pending) == 0)
        for seg in failed:
            self._replace(seg)

    def _replace(self, seg: _Segment) -> None:
        """A corrupt entry: recompute the chunk into the staging buffers, evict and store it anew."""
        key = self.engine.store.key_for(self.model, seg.chunk.token_ids)
        fresh = prefill_chunk(self.model, list(seg.chunk.token_ids))
        seg.chunk.keys.copy_(fresh.keys)
        seg.chunk.values.copy_(fresh.values)
        for have in seg.have:
            have.fill_(True)
        seg.reader.close()
        seg.reader = None
        self.engine.store.delete(key)
        self.engine.store.put(fresh)
        self.engine.stats.num_recomputed += 1

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put((-1, -1, None, None))
        for t in self._workers:
            t.join()
        for segs in self.segments:
            for seg in segs:
                if seg.reader is not None:
                    seg.reader.close()
        self.engine.stats.stall_s += self.stall_s

    def __enter__(self) -> "BatchTransfer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
