"""The connector's cache layouts against vLLM's own code (`vllm_layout_probe`, run with the Python
of vLLM's CPU build; `make test-vllm`): `paged_layouts.LAYOUTS` is vLLM's `KVCacheLayout`; for
FLASH_ATTN and TRITON_ATTN in every layout, the (K, V) views vLLM's own cache update hands its op
are the connector's; FlashInfer's update splits its cache the same way; a CPU cache gets vLLM's
CPU op, and a CPU build has no flash op (so flash caches there take the index write)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import vllm_server
from tests.integrations.paged_layouts import FLASH_BACKENDS, LAYOUTS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


def test_the_connectors_layouts_are_vllms():
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run([str(vllm_server.python()), str(REPO / "tests/integrations/vllm_layout_probe.py")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["layouts"] == {name: list(order) for name, order in LAYOUTS.items()}
    assert found["views"] == {f"{b}/{layout}": True for b in FLASH_BACKENDS if b != "FLASHINFER" for layout in LAYOUTS}
    assert found["flashinfer_split"] is True
    assert found["cpu_writer"] == "cpu_attn_reshape_and_cache"
    assert found["ops"] == {"reshape_and_cache_flash": False, "cpu_attn_reshape_and_cache": True}
