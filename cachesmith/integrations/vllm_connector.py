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
(cachesmith's decoder), loaded once where vLLM's caches live, in their dtype
(`connector_worker`). The rows are written by vLLM's cache op of each layer's backend
(FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN) where the build has it, else by an index write
(`paged_kv`). A quantized KV cache and parallel sizes above 1 are refused at start.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm._custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from cachesmith.integrations.connector_book import Load, LoadBook, StoreSettings
from cachesmith.integrations.connector_builds import Builds
from cachesmith.integrations.connector_worker import ConnectorWorker, check_parallel
from cachesmith.integrations.paged_kv import PagedCache, VllmOps, check_kv_cache_dtype
from cachesmith.integrations.vllm_stats import ConnectorPromMetrics, ConnectorStats

# a child of vLLM's logger: vLLM's handler prints the connector's lines among its own
log = logging.getLogger("vllm.cachesmith_connector")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class CachesmithMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


@dataclass
class CachesmithWorkerMetadata(KVConnectorWorkerMetadata):
    reports: dict[str, dict] = field(default_factory=dict)  # request id -> its kv_transfer_params

    def aggregate(self, other: CachesmithWorkerMetadata) -> CachesmithWorkerMetadata:
        return CachesmithWorkerMetadata({**self.reports, **other.reports})


def vllm_ops() -> VllmOps:
    """vLLM's cache-write ops that this build registered (a CPU build has no flash op)."""
    cache_ops = getattr(torch.ops, "_C_cache_ops", None)
    has_flash = cache_ops is not None and hasattr(cache_ops, "reshape_and_cache_flash")
    return VllmOps(ops.reshape_and_cache_flash if has_flash else None,
                   getattr(ops, "cpu_attn_reshape_and_cache", None))


def paged_caches(kv_caches: dict[str, torch.Tensor], layers: dict[str, Any]) -> list[PagedCache]:
    """The registered caches with what their attention layers (vLLM's forward context) say."""
    caches = []
    for name, kv_cache in kv_caches.items():
        m, layer = _LAYER.search(name), layers.get(name)
        if m is None or layer is None:
            raise ValueError(f"CachesmithConnector: registered cache {name!r} is no decoder layer's attention")
        caches.append(PagedCache(int(m.group(1)), layer.attn_backend.get_name(), kv_cache, layer.num_kv_heads,
                                 layer.head_size, getattr(layer, "isa", "")))
    return caches


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
        check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
        parallel = vllm_config.parallel_config
        check_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self._static_layers = vllm_config.compilation_config.static_forward_context
        extra = self._kv_transfer_config.get_from_extra_config
        load_async = extra("load_async", True)
        if not isinstance(load_async, bool):
            raise ValueError(f"CachesmithConnector: kv_connector_extra_config.load_async={load_async!r} must be "
                             "true (build off vLLM's step) or false (inside it)")
        self.book = LoadBook(load_async)  # scheduler side
        self.worker = ConnectorWorker(extra("model", "smollm2-135m"), StoreSettings.from_extra(extra),
                                      vllm_config.cache_config.block_size, vllm_ops())
        self.builds = Builds(self.worker.build, load_async)  # worker side
        self._outgoing: dict[str, dict] = {}  # worker: reports for the scheduler, sent after this step
        self._failed_blocks: set[int] = set()  # worker: blocks of failed builds, reported after this step
        self._stats = ConnectorStats()

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
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # at start-up: the decoder is loaded where the caches live, in their dtype, and each
        # layer's writer chosen (`connector_worker.ConnectorWorker.register`)
        for line in self.worker.register(paged_caches(kv_caches, self._static_layers)).lines():
            log.info(line)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        loads = getattr(self._get_connector_metadata(), "loads", ())
        if loads:
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
