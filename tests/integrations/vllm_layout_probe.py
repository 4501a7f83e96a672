"""Run by `test_vllm_layouts` with vLLM's Python: checks the connector's layouts against vLLM's own
code and prints one JSON object of findings.

- `layouts`: vLLM's `KVCacheLayout` members, to compare with `paged_layouts.LAYOUTS`;
- `views`: per backend whose module imports on this build, and per layout, whether the (K, V)
  views vLLM's own `do_kv_cache_update` hands its cache op alias exactly the connector's
  `PagedCache.views()` (shape, strides, offset into one buffer): vLLM's method runs with its op
  replaced by one that records what it was given;
- `flashinfer_split`: whether FlashInfer's cache update splits the view as the flash backends do
  (its module needs the flashinfer package, so its source is read instead);
- `cpu_writer`: the writer a CPU cache gets on this build (vLLM's own op; the answers of
  `test_vllm_connector` check what it writes).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
import types
from pathlib import Path

import torch

from cachesmith.integrations.paged_kv import VllmOps, writer_for
from cachesmith.integrations.vllm_connector import vllm_ops
from tests.integrations.paged_layouts import LAYOUTS, Pool

HEADS, BLOCK, DIM = 2, 16, 64
FLASH_IMPLS = {"FLASH_ATTN": ("flash_attn", "FlashAttentionImpl", "reshape_and_cache_flash"),
               "TRITON_ATTN": ("triton_attn", "TritonAttentionImpl", "triton_reshape_and_cache_flash")}


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())


def vllm_views(backend: str, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module_name, impl_name, op_name = FLASH_IMPLS[backend]
    module = importlib.import_module(f"vllm.v1.attention.backends.{module_name}")
    seen = {}
    setattr(module, op_name, lambda key, value, k_cache, v_cache, *rest: seen.update(k=k_cache, v=v_cache))
    impl = types.SimpleNamespace(attn_type="decoder", head_size=DIM, kv_cache_dtype="auto",
                                 _is_per_token_head_quant=False)
    layer = types.SimpleNamespace(_k_scale=None, _v_scale=None)
    rows = torch.zeros(3, HEADS, DIM)
    getattr(module, impl_name).do_kv_cache_update(impl, layer, rows, rows, kv_cache, torch.arange(3))
    return seen["k"], seen["v"]


def views() -> dict:
    out = {}
    for backend in FLASH_IMPLS:
        for layout in LAYOUTS:
            cache = Pool(layout, 2, 4, HEADS, BLOCK, DIM).caches(backend, HEADS)[1]
            theirs, ours = vllm_views(backend, cache.kv_cache), cache.views()
            out[f"{backend}/{layout}"] = all(same_view(a, b) for a, b in zip(theirs, ours))
    return out


def flashinfer_split() -> bool:
    import vllm
    source = (Path(vllm.__file__).parent / "v1/attention/backends/flashinfer.py").read_text()
    impl = source[source.index("class FlashInferImpl"):]
    update = impl[impl.index("def do_kv_cache_update"):]
    update = re.split(r"\n    def |\ndef |\nclass ", update[1:])[0]
    return bool(re.search(r"kv_cache\.transpose\(1, 2\)\.split\(\s*self\.head_size, dim=-1\s*\)", update))


def cpu_writer() -> str:
    pool = Pool("LBHNC", 1, 4, HEADS, BLOCK, DIM)
    cache = dataclasses.replace(pool.caches("CPU_ATTN", HEADS)[0], isa="vec16")
    return writer_for(cache, vllm_ops())[0]


if __name__ == "__main__":
    from vllm.v1.kv_cache_layout import KVCacheLayout

    print(json.dumps({"layouts": {m.name: list(m.value) for m in KVCacheLayout}, "views": views(),
                      "flashinfer_split": flashinfer_split(), "cpu_writer": cpu_writer(),
                      "ops": {name: op is not None for name, op in zip(VllmOps._fields, vllm_ops())}}))
