"""A vLLM v1 KV connector: vLLM serves, cachesmith builds the KV of a RAG prompt.

In: a vLLM request whose `kv_transfer_params` carry `{"cachesmith": {"num_prefix_tokens": P,
"chunk_token_counts": [n_1, ...], "method": "cachesmith", "slo_ms": 2000}}`: the prompt's token ids
are a prefix of P tokens, the documents' chunks of n_i tokens each, then the question
(`prompt_kv.ConnectorParams`); and its `cache_salt`, if any, which keys its chunks in a store
namespace of their own (equal text under two salts: two entries, neither read for the other). Out:
the KV of every prompt token but the last, computed by cachesmith's own engine (stored chunks, the
planner's plan for what is left of the request's SLO or a fixed method, selective recomputation)
and written into vLLM's paged blocks with vLLM's own cache-write op. vLLM computes the last token
and decodes, so the request answers as cachesmith's engine answers with that plan (and, at full
coverage, as vLLM alone answers). The response's `kv_transfer_params` report what the build took
(`prompt_kv.LoadReport`, with `num_rebuilds`), or the field a request got wrong; vLLM's /metrics
gain `cachesmith:vllm_*` counters (`vllm_stats`).

Builds run off vLLM's step by default (`"load_async": true`): vLLM allocates the request's blocks,
keeps it waiting for its KV while the other requests keep decoding, and schedules it once the
builder thread reports it received (`connector_builds`). `"load_async": false` builds inside the
step that schedules the request, as before; the whole batch waits for it.

Preemption: when vLLM preempts a request it frees its blocks; on resuming it asks the connector
again and allocates new ones. The connector rebuilds the prompt's KV into those blocks, with the
plan of its first build (`connector_book`): rebuilding rather than reporting the load as failed
keeps the answer the one the plan gives, and costs a build rather than a full prefill by vLLM.

Failures: parameters that do not fit the prompt, or a cache_salt the store cannot take, are refused
by name and the request is vLLM's alone. A build that fails (a store that cannot serve a chunk, no
memory) reports its blocks as failed loads, and vLLM, launched with `"kv_load_failure_policy":
"recompute"`, prefills the prompt itself (and again if it resumes the request later). vLLM's prefix
cache must be off (`--no-enable-prefix-caching`): it would register the connector's planned,
approximate KV as the exact KV of those tokens for every later request.

vLLM loads it with `--kv-transfer-config '{"kv_connector": "CachesmithConnector",
"kv_connector_module_path": "cachesmith.integrations.vllm_connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"model": "smollm2-135m"}}'`;
extra config also takes `load_async`, `store_tiers`, `store_root` and `redis_url`, as `cachesmith
serve` does, so both can share one redis store. The worker holds a second copy of the weights
(cachesmith's decoder). Written for vLLM's CPU attention backend (`ops.cpu_attn_reshape_and_cache`);
on another backend every build falls back to vLLM's prefill, with the reason logged.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from cachesmith.integrations.connector_book import Load, LoadBook, StoreSettings
from cachesmith.integrations.connector_builds import Built, Builds
from cachesmith.integrations.prompt_kv import PARAMS_KEY, PromptPlan, build_prompt_kv
from cachesmith.integrations.vllm_stats import ConnectorPromMetrics, ConnectorStats
from cachesmith.plan_one import one_planner

log = logging.getLogger(__name__)
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class CachesmithMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


@dataclass
class CachesmithWorkerMetadata(KVConnectorWorkerMetadata):
    reports: dict[str, dict] = field(default_factory=dict)  # request id -> its kv_transfer_params

    def aggregate(self, other: CachesmithWorkerMetadata) -> CachesmithWorkerMetadata:
        return CachesmithWorkerMetadata({**self.reports, **other.reports})


def write_cpu_cache(layer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows `key`/`value` [num_rows, num_kv_heads, head_dim] into vLLM's CPU paged cache of `layer`."""
    if not hasattr(layer, "isa"):
        raise NotImplementedError(f"attention backend of {type(layer).__name__}: the connector writes "
                                  "vLLM's CPU attention cache only")
    num_blocks, num_kv_heads, block_size, _ = layer.kv_cache.shape  # [B, Hkv, N, 2 * D]: K | V
    key_cache, value_cache = layer.kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, slots, layer.isa)


def build_counts(load: Load, report, num_rows: int) -> dict[str, int]:
    """One build's counters for vLLM's stats (`vllm_stats.SERIES`)."""
    outcome = "prompts_rebuilt" if load.num_rebuilds else "prompts_built"
    return {outcome: 1, "chunks_stored": report.num_chunks_stored, "chunks_prefilled": report.num_chunks_prefilled,
            "stored_tokens": report.num_stored_tokens, "recomputed_tokens": report.num_recomputed_tokens,
            "written_tokens": num_rows}


class CachesmithConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("CachesmithConnector: launch vLLM with --no-enable-prefix-caching; its prefix "
                             "cache would reuse the connector's planned KV as exact KV of those tokens")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("CachesmithConnector: kv_load_failure_policy is %r; a failed build fails its request "
                        "instead of falling back to vLLM's prefill ('recompute')",
                        self._kv_transfer_config.kv_load_failure_policy)
        self.block_size = vllm_config.cache_config.block_size
        self.dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        extra = self._kv_transfer_config.get_from_extra_config
        self.model_name = extra("model", "smollm2-135m")
        self.store = StoreSettings.from_extra(extra)
        load_async = extra("load_async", True)
        if not isinstance(load_async, bool):
            raise ValueError(f"CachesmithConnector: kv_connector_extra_config.load_async={load_async!r} must be "
                             "true (build off vLLM's step) or false (inside it)")
        self.book = LoadBook(load_async)  # scheduler side
        self.builds = Builds(self._build, load_async)  # worker side
        self._outgoing: dict[str, dict] = {}  # worker: reports for the scheduler, sent after this step
        self._failed_blocks: set[int] = set()  # worker: blocks of failed builds, reported after this step
        self._layers: dict[int, Any] = {}  # worker: decoder layer index -> vLLM's attention layer
        self._stats = ConnectorStats()
        self._pipe = None

    @property
    def requires_kv_delivery(self) -> bool:
        # the connector hands no KV off (it never saves): vLLM need not drop a preempted request's
        # in-flight output on its account
        return False

    # ---- scheduler side: claim every prompt token but the last of a request that asks for cachesmith
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.book.claim(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        # new requests and resumed ones alike: the blocks are the request's whole allocation
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.book.allocated(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return CachesmithMetadata(self.book.take_loads())

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, CachesmithWorkerMetadata):
            self.book.reported(meta.reports)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # never delays the free: vLLM itself keeps the blocks of a request aborted mid-load until
        # the load is reported received
        return False, self.book.finished(request.request_id)

    # ---- worker side: cachesmith's KV of the prompt, written where vLLM's blocks hold those rows
    def _pipeline(self):
        if self._pipe is None:
            from cachesmith.kvstore import ChunkStore
            from cachesmith.pipeline import RagPipeline  # the worker's second copy of the weights

            self._pipe = RagPipeline(self.model_name, dtype=self.dtype, store=ChunkStore(self.store.config()))
        return self._pipe

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # at start-up, so that no request's clock pays for loading the weights and the planner's
        # profile (calibrating a packaged profile to the machine takes seconds)
        one_planner(self._pipeline())

    def _build(self, load: Load, plan: PromptPlan | None) -> Built:
        """Build and write one prompt's KV (on the builder thread when asynchronous)."""
        slots = load.slots(self.block_size)
        waited_s = max(0.0, time.time() - load.arrival_time)
        kv = build_prompt_kv(self._pipeline(), load.token_ids, load.params, waited_s,
                             namespace=load.namespace, plan=plan)
        try:
            n = load.num_rows
            for i, layer in self._layers.items():
                write_cpu_cache(layer, kv.cache.key_slab[i, :n], kv.cache.value_slab[i, :n], slots)
        finally:
            kv.cache.release()
        params = kv.report.to_params()
        params[PARAMS_KEY]["num_rebuilds"] = load.num_rebuilds
        return Built(params, build_counts(load, kv.report, load.num_rows), kv.plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        loads = getattr(self._get_connector_metadata(), "loads", ())
        if not loads:
            return
        if not self._layers:  # the model's attention layers, fixed for the worker's life
            self._layers = {int(m.group(1)): layer for name, layer in forward_context.no_compile_layers.items()
                            if getattr(layer, "kv_cache", None) is not None and (m := _LAYER.search(name))}
        self.builds.start(loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: nothing is sent, the asynchronous loads that ended). vLLM calls this first of the
        step's results, so the failed blocks and reports of those loads go out in the same step."""
        results = self.builds.drain(finished_req_ids)
        self._outgoing.update(results.reports)
        self._failed_blocks |= results.failed_blocks
        for counts in results.counts:
            self._stats.add(**counts)
        return None, results.received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._outgoing:
            return None
        reports, self._outgoing = self._outgoing, {}
        return CachesmithWorkerMetadata(reports)

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, ConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats:
        return ConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> ConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # synchronous builds end before the forward starts; asynchronous ones before vLLM schedules
        # their request (they are not in the batch until received)
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        self.builds.shutdown()
