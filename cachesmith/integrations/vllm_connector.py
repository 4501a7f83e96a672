"""A vLLM v1 KV connector: vLLM serves, cachesmith builds the KV of a RAG prompt.

In: a vLLM request whose `kv_transfer_params` carry `{"cachesmith": {"num_prefix_tokens": P,
"chunk_token_counts": [n_1, ...], "method": "cachesmith", "slo_ms": 2000}}`: the prompt's token ids
are a prefix of P tokens, the documents' chunks of n_i tokens each, then the question
(`prompt_kv.ConnectorParams`). Out: the KV of every prompt token but the last, computed by
cachesmith's own engine (stored chunks, the planner's plan for what is left of the request's SLO or
a fixed method, selective recomputation) and written into vLLM's paged blocks with vLLM's own
cache-write op. vLLM computes the last token and decodes, so the request answers as cachesmith's
engine answers with that plan (and, at full coverage, as vLLM alone answers). The response's
`kv_transfer_params` report what the build took (`prompt_kv.LoadReport`), or the field a request
got wrong; vLLM's /metrics gain `cachesmith:vllm_*` counters (`vllm_stats`).

Failures: parameters that do not fit the prompt are refused by name and the request is vLLM's
alone. A build that fails (a store that cannot serve a chunk, no memory) reports its blocks as
failed loads, and vLLM, launched with `"kv_load_failure_policy": "recompute"`, prefills the prompt
itself. vLLM's prefix cache must be off (`--no-enable-prefix-caching`): it would register the
connector's planned, approximate KV as the exact KV of those tokens for every later request.

vLLM loads it with `--kv-transfer-config '{"kv_connector": "CachesmithConnector",
"kv_connector_module_path": "cachesmith.integrations.vllm_connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"model": "smollm2-135m"}}'`;
extra config also takes `store_tiers`, `store_root` and `redis_url`, as `cachesmith serve` does, so
both can share one redis store. The worker holds a second copy of the weights (cachesmith's
decoder). Written for vLLM's CPU attention backend (`ops.cpu_attn_reshape_and_cache`); on another
backend every build falls back to vLLM's prefill, with the reason logged.
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

from cachesmith.errors import InputError
from cachesmith.integrations.prompt_kv import PARAMS_KEY, ConnectorParams, build_prompt_kv
from cachesmith.integrations.vllm_stats import ConnectorPromMetrics, ConnectorStats

log = logging.getLogger(__name__)
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """One request's prompt, its parameters, and where vLLM's blocks hold its rows."""
    request_id: str
    token_ids: list[int]
    params: ConnectorParams
    arrival_time: float  # when vLLM received the request (time.time())
    block_ids: list[int]
    slots: torch.Tensor  # [num_prompt_tokens - 1] int64


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
        self.store = {"tiers": tuple(extra("store_tiers", ("memory", "disk"))), "root": extra("store_root", None),
                      "redis_url": extra("redis_url", None)}
        self._pending: dict[str, tuple[list[int], ConnectorParams, float]] = {}  # (ids, params, arrival)
        self._reports: dict[str, dict] = {}  # scheduler: request id -> what to return; worker: to send
        self._in_flight: set[str] = set()  # scheduler: loads sent to the workers, not yet reported
        self._awaiting: dict[str, dict] = {}  # scheduler: finished requests' params, filled on report
        self._failed_blocks: set[int] = set()
        self._stats = ConnectorStats()
        self._pipe = None

    # ---- scheduler side: claim every prompt token but the last of a request that asks for cachesmith
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        raw = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if raw is None:
            return 0, False
        try:
            params = ConnectorParams.parse(raw, len(request.prompt_token_ids))
        except InputError as exc:  # the request is vLLM's alone; its response names the field
            log.warning("request %s: %s", request.request_id, exc)
            self._reports[request.request_id] = {PARAMS_KEY: {"error": str(exc)}}
            return 0, False
        self._pending[request.request_id] = (list(request.prompt_token_ids), params, request.arrival_time)
        return max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = CachesmithMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is None:
                continue
            token_ids, params, arrival_time = pending
            block_ids = list(new_req.block_ids[0])
            blocks = torch.tensor(block_ids, dtype=torch.int64)
            slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
            meta.loads.append(Load(new_req.req_id, token_ids, params, arrival_time, block_ids,
                                   slots[:len(token_ids) - 1]))
            self._in_flight.add(new_req.req_id)
        return meta

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        for request_id, report in meta.reports.items() if isinstance(meta, CachesmithWorkerMetadata) else ():
            self._in_flight.discard(request_id)
            awaiting = self._awaiting.pop(request_id, None)
            if awaiting is not None:
                awaiting.update(report)
            else:
                self._reports[request_id] = report

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        if request.request_id in self._in_flight:
            # A request that ends in its first step (one token) finishes before vLLM hands the
            # scheduler that step's worker output; the dict returned here goes out with the
            # response after this step, so `update_connector_output` fills it in place.
            self._in_flight.discard(request.request_id)
            self._awaiting[request.request_id] = {}
            return False, self._awaiting[request.request_id]
        return False, self._reports.pop(request.request_id, None)

    # ---- worker side: cachesmith's KV of the prompt, written where vLLM's blocks hold those rows
    def _pipeline(self):
        if self._pipe is None:
            from cachesmith.kvstore import ChunkStore, StoreConfig
            from cachesmith.pipeline import RagPipeline  # the worker's second copy of the weights

            self._pipe = RagPipeline(self.model_name, dtype=self.dtype, store=ChunkStore(StoreConfig(**self.store)))
        return self._pipe

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # at start-up, so that no request's clock pays for loading the weights and the planner's
        # profile (calibrating a packaged profile to the machine takes seconds)
        self._pipeline().one_planner()

    def _load(self, load: Load, layers: dict) -> dict:
        """Build and write one prompt's KV; its report."""
        waited_s = max(0.0, time.time() - load.arrival_time)
        cache, report = build_prompt_kv(self._pipeline(), load.token_ids, load.params, waited_s)
        try:
            n = len(load.slots)
            for i, layer in layers.items():
                write_cpu_cache(layer, cache.key_slab[i, :n], cache.value_slab[i, :n], load.slots)
        finally:
            cache.release()
        self._stats.add(prompts_built=1, chunks_stored=report.num_chunks_stored,
                        chunks_prefilled=report.num_chunks_prefilled, stored_tokens=report.num_stored_tokens,
                        recomputed_tokens=report.num_recomputed_tokens, written_tokens=n)
        return report.to_params()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        loads = getattr(self._get_connector_metadata(), "loads", ())
        if not loads:
            return
        layers = {int(m.group(1)): layer for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and (m := _LAYER.search(name))}
        for load in loads:
            try:
                self._reports[load.request_id] = self._load(load, layers)
            except Exception as exc:  # noqa: BLE001  any failure: vLLM prefills, never a wrong answer
                log.warning("request %s: cachesmith could not build its KV (%s: %s); vLLM prefills it",
                            load.request_id, type(exc).__name__, exc)
                self._failed_blocks.update(load.block_ids)
                self._stats.add(prompts_fallback=1)
                self._reports[load.request_id] = {PARAMS_KEY: {"error": f"{type(exc).__name__}: {exc}",
                                                               "fallback": "vllm_prefill"}}

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
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
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
