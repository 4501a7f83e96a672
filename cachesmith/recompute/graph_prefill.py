"""Recompute plans on CUDA as captured CUDA graphs: static buffers per bucket, replayed.

In: a batch of `RecomputeRequest`s whose prefix and chunks are handed in memory, and a plan whose
selection the device makes at a size known before the run: `position` plans (full reuse, EPIC: the
rows come from chunk bounds, on the host), KV deviation at any (w, p) (CacheBlend's (1, 0)), and
the query's attention: QCI (ProphetKV), FusionRAG's last layer, and both fused with KV deviation.
Out: one `RecomputeOutput` per request, as `BatchRunner.run` gives it up to floating-point rounding.

Why: the eager layer loop dispatches 50-70 torch ops per layer, and a GPU pays each one in host
time (about 9.6 us each on the one GPU run so far), which at 32 layers is more than the device work
of a 2K-token full reuse. A CUDA graph launches them all at once, but replays the same kernels on
the same memory with no host value read inside. So a batch runs in a bucket of padded sizes (vLLM's
CUDA-graph runner pads the same way): B requests (the smallest of `BATCH_BUCKETS` >= n), S positions
(above every request's tokens), K selected rows and Q suffix rows (at least the largest), each
padded to its size class (`graph_buffers.size_class`: under 1/16 past a few thousand rows), and a
replay computes every row of the bucket:

- static slabs keys / values [B, L, S, Hkv, D]: request b's cached rows (pre-RoPE) are copied into
  rows [0, end_b) before the replay (one concatenation per tensor), and rotated inside it;
- position S - 1 is every request's trash row: padding slots compute there and write their K/V
  there, and no real row sees it (key j is visible to a row at position p iff j <= p < S - 1);
- static inputs in one host copy: token ids [B, S], per request its prefix and suffix bounds,
  tokens, rows selected and suffix rows, and EPIC's selection [B, K];
- one run: WarmUp (and KV deviation's probe) layers over all B x S rows, causal; a query probe's
  layers over the B x Q question rows alone, masked by position (`graph_probe`); the scores
  ranked on the device by a stable sort (`signals.rank`'s order; `signals.fuse`'s for the fused
  plans) and each request's first k_b rows taken, sorted by position; Patch layers over the
  B x (K + Q) selected and suffix rows, each at its position, attention masked by position; the
  logits of each last suffix row.

After the replay each request's cache is its slab rows, lent (`KVCache.lent`, as decode's graph
lends its rows): the next replay of the bucket, or its eviction, first moves any cache still there
into slabs of its own (one copy per tensor), and one that decoding moved out already (its move to
the head-major layout) or released costs nothing more. The selection comes back in one copy (eager
ranking reads its scores back once too). A run's caches are used on the runner's thread, or moved
out (`KVCache.own`) before its next run. Eager serves what
is not graphed (`GraphPrefill.takes`): full prefill, plans decided after layer 0 (they read the
entropies back), runs with per-layer hooks (staging, the runtime monitor, layer timing)
and caches staged by the transfer engine.
"""
from __future__ import annotations

import logging

import torch

from cachesmith.model import Decoder
from cachesmith.model import device as accel
from cachesmith.recompute.config import RecomputeConfig, Signal
from cachesmith.recompute.graph_buffers import BucketKey, PrefillBuffers, RequestLayout, bucket_bytes, size_class
from cachesmith.recompute.run_state import RecomputeOutput
from cachesmith.recompute.sequence import RecomputeRequest, checked, chunk_starts
from cachesmith.recompute.signals import chunk_heads, num_selected

log = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
GIB = 1 << 30
# Rows x parameters per layer above which a run's device work hides its launches, so a graph only
# adds its padding: where a layer's matmuls (2 x params FLOPs a row, at the fit compute efficiency
# 0.6 of an H100's 989 TFLOP/s) take as long as the eager loop's host calls for that layer (about
# 42 at 9.6 us each). For the 8B shape (218M parameters a layer) that is about 550 rows a layer,
# near vLLM's largest captured batch (512 tokens) and for the same reason; a narrower model graphs
# proportionally more rows.
MAX_ROW_PARAMS = int(42 * 9.6e-6 * 989e12 * 0.6 / 2)


class GraphPrefill:
    """Runs `BatchRunner`'s graphable plans as replays of captured graphs (CUDA only). Buckets are
    kept while they fit the model's `max_graph_bytes` (the server's budget for graphs; None: the
    device's free memory), the least recently used freed
    first; a batch no bucket can hold runs eager."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self._buckets: dict[BucketKey, PrefillBuffers] = {}  # least recently used first
        self._refused: set[BucketKey] = set()
        self.num_captures = 0
        self.num_replays = 0
        self.max_row_params = MAX_ROW_PARAMS  # a larger run goes eager (`is_launch_bound`)

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self._buckets.values())

    def takes(self, requests: list[RecomputeRequest], config: RecomputeConfig) -> bool:
        """Whether this batch and plan run from a graph."""
        num_layers = self.model.num_layers
        if len(requests) > BATCH_BUCKETS[-1]:
            return False
        if not config.has_patch(num_layers):
            return False
        if any(r.cache is not None for r in requests):  # staged caches fill layer by layer: eager
            return False
        return self.is_launch_bound(requests, config)

    def is_launch_bound(self, requests: list[RecomputeRequest], config: RecomputeConfig,
                        num_layers: int | None = None) -> bool:
        """Whether the run's rows per layer (on average over its layers) times the parameters of a
        layer are within `max_row_params`: above it the device's work outlasts the eager loop's
        launches, and a graph would only add its padding (the forecast prices CacheBlend@15% at 8K
        and 16K tokens 3-3.5% slower graphed on an H100). `num_layers`: the model's, or the depth a
        model of these layers would have (the forecast runs the 8B shape at 2 and 3 layers)."""
        num_layers = num_layers or self.model.num_layers
        full = config.patch_start
        probe = {Signal.KV_DEV: 0, Signal.POSITION: 0, Signal.QCI: config.probe}.get(config.signal,
                                                                                   num_layers - config.warmup)
        row_layers = 0
        for r in requests:
            num_context = sum(c.num_tokens for c in r.chunks)
            num_prefix = r.prefix.num_tokens if r.prefix is not None else 0
            num_question = len(r.suffix_ids)
            patch = num_selected(config.coverage, num_context) + num_question
            row_layers += (full * (num_prefix + num_context + num_question) + probe * num_question
                           + (num_layers - full) * patch)
        return row_layers * self.model.config.num_layer_parameters <= self.max_row_params * num_layers

    def run(self, requests: list[RecomputeRequest], config: RecomputeConfig) -> list[RecomputeOutput] | None:
        """The batch's outputs from a replay, or None where no bucket fits the device (eager then).
        Inputs are checked first, with the eager path's errors."""
        layouts = [self._layout(r, config, i) for i, r in enumerate(requests)]
        with torch.inference_mode():  # the bucket's buffers are only ever used inside it
            bucket = self._bucket(self._key(layouts, config))
        if bucket is None:
            return None
        with torch.inference_mode():
            bucket.load(layouts)
            bucket.graph.replay()
            self.num_replays += 1
        caches = bucket.lend(layouts)
        with torch.inference_mode():
            return bucket.outputs(layouts, caches)

    def _layout(self, req: RecomputeRequest, config: RecomputeConfig, index: int) -> RequestLayout:
        coverage, _ = checked(self.model, req, config.coverage, index)
        num_prefix = req.prefix.num_tokens if req.prefix is not None else 0
        num_context = sum(c.num_tokens for c in req.chunks)
        if config.signal is Signal.POSITION:
            chosen = range(num_context) if coverage >= 1.0 else chunk_heads(chunk_starts(req), num_context,
                                                                            coverage).tolist()
            selected = [num_prefix + i for i in chosen]
            num_chosen = len(selected)
        else:
            selected, num_chosen = None, num_selected(coverage, num_context)
        return RequestLayout(req, [int(t) for t in req.suffix_ids], num_prefix, num_context, num_chosen, selected)

    def _key(self, layouts: list[RequestLayout], config: RecomputeConfig) -> BucketKey:
        num_rows = next(b for b in BATCH_BUCKETS if b >= len(layouts))
        length = size_class(max(lay.num_tokens for lay in layouts) + 1, 64)  # + the trash row
        most = max(lay.num_selected for lay in layouts)
        return BucketKey(config.signal.value, config.warmup, config.probe, config.kv_dev_target, config.patch_start,
                         num_rows, length,
                         0 if most == 0 else size_class(most, 16),
                         size_class(max(lay.num_suffix for lay in layouts), 16))

    def _bucket(self, key: BucketKey) -> PrefillBuffers | None:
        """A kept bucket that fits `key` (now the most recently used), or a new one, captured."""
        for have, bucket in self._buckets.items():
            if have.fits(key):
                self._buckets[have] = self._buckets.pop(have)
                return bucket
        need = bucket_bytes(self.model, key)
        while self._buckets and not self._has_room(need):
            self._buckets.pop(next(iter(self._buckets))).recall()  # freed before the new one is allocated
        if not self._has_room(need):
            if key not in self._refused:
                self._refused.add(key)
                log.warning("prefill graphs: a bucket of %d requests x %d positions needs %.2f GiB, more than "
                            "the budget or the device has free; its batches run eager", key.num_rows, key.length,
                            need / GIB)
            return None
        bucket = PrefillBuffers(self.model, key)
        bucket.graph = accel.new_graph(self.model.device)
        bucket.graph.capture(bucket.step)
        self._buckets[key] = bucket
        self.num_captures += 1
        return bucket

    def _has_room(self, need: int) -> bool:
        budget = self.model.max_graph_bytes
        if budget is not None and self.num_bytes + need > budget:
            return False
        free, _total = accel.memory_info(self.model.device)
        return need <= free


__all__ = ["BATCH_BUCKETS", "GraphPrefill"]
