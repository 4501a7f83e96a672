"""A vLLM v1 KV connector: vLLM serves, cachesmith builds the KV of a RAG prompt.

In: a vLLM request whose `kv_transfer_params` carry `{"cachesmith": {"num_prefix_tokens": P,
"chunk_token_counts": [n_1, ...], "method": "cacheblend@0.15"}}`: the prompt's token ids are a
prefix of P tokens, the documents' chunks of n_i tokens each, then the question. Out: the KV of
every prompt token but the last, computed by cachesmith's own engine (stored chunks, the method's
plan, selective recomputation) and written into vLLM's paged blocks with vLLM's own cache-write
op. vLLM computes the last token and decodes, so the request answers as cachesmith's engine
answers with that plan (and, at full coverage, as vLLM alone answers).

vLLM loads it with `--kv-transfer-config '{"kv_connector": "CachesmithConnector",
"kv_connector_module_path": "cachesmith.integrations.vllm_connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"model": "smollm2-135m"}}'`; cachesmith must be importable in vLLM's
environment. The worker holds a second copy of the weights (cachesmith's decoder) and its own
chunk store. Requests without those parameters are vLLM's alone. Written for vLLM's CPU attention
backend (`ops.cpu_attn_reshape_and_cache`); the GPU backends' cache-write ops are not wired yet.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

PARAMS_KEY = "cachesmith"
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """One request's prompt, its cachesmith parameters, and the paged-cache slots of its rows."""
    token_ids: list[int]
    params: dict
    slots: torch.Tensor  # [num_prompt_tokens - 1] int64


@dataclass
class CachesmithMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class CachesmithConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.model_name = self._kv_transfer_config.get_from_extra_config("model", "smollm2-135m")
        self._pending: dict[str, tuple[list[int], dict]] = {}
        self._pipe = None

    # scheduler side: claim every prompt token but the last for a request that asks for cachesmith
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not (request.kv_transfer_params or {}).get(PARAMS_KEY):
            return 0, False
        return max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending[request.request_id] = (list(request.prompt_token_ids),
                                                 request.kv_transfer_params[PARAMS_KEY])

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = CachesmithMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is None:
                continue
            token_ids, params = pending
            blocks = torch.tensor(new_req.block_ids[0], dtype=torch.int64)
            slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
            meta.loads.append(Load(token_ids, params, slots[:len(token_ids) - 1]))
        return meta

    # worker side: cachesmith's KV of the prompt, written where vLLM's blocks hold those rows
    def _pipeline(self):
        if self._pipe is None:
            from cachesmith.pipeline import RagPipeline  # the worker's second copy of the weights

            self._pipe = RagPipeline(self.model_name)
        return self._pipe

    def _prompt_kv(self, load: Load):
        """cachesmith's `KVCache` of the whole prompt under the request's method."""
        from cachesmith.methods import parse_method
        from cachesmith.model.tokenizer import PromptParts

        pipe, params = self._pipeline(), load.params
        num_prefix = int(params["num_prefix_tokens"])
        prefix, rest, chunks = load.token_ids[:num_prefix], load.token_ids[num_prefix:], []
        for n in params["chunk_token_counts"]:
            chunks.append(rest[:int(n)])
            rest = rest[int(n):]
        plan = parse_method(params.get("method", "cacheblend@0.15")).plan(pipe.model.num_layers)
        request = pipe.keyed_request(PromptParts(prefix, chunks, rest), 1)
        with pipe.transfer.stage([request], plan) as batch:
            return pipe.runner.run(batch.requests, plan, batch)[0].cache

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        for load in getattr(self._get_connector_metadata(), "loads", ()):
            cache, n = self._prompt_kv(load), len(load.slots)
            for name, layer in forward_context.no_compile_layers.items():
                kv_cache, match = getattr(layer, "kv_cache", None), _LAYER.search(name)
                if kv_cache is None or match is None or not hasattr(layer, "isa"):
                    continue
                i = int(match.group(1))
                num_blocks, num_kv_heads, block_size, _ = kv_cache.shape  # [B, Hkv, N, 2 * D]: K | V
                key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(cache.key_slab[i, :n].contiguous(), cache.value_slab[i, :n].contiguous(),
                                               key_cache, value_cache, load.slots, layer.isa)
            cache.release()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
