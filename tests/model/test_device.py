"""One door to the accelerator: `torch.cuda` is named in `cachesmith/model/device.py` alone, so
the simulated device (which replaces that module's backend) sees every stream, event and sync."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from cachesmith.model import device as accel

ROOT = Path(__file__).resolve().parents[2]
DEVICE_MODULE = ROOT / "cachesmith" / "model" / "device.py"
CUDA_CALL = re.compile(r"\btorch\.cuda\b|\bfrom torch import cuda\b|\bimport torch\.cuda\b")


def test_no_torch_cuda_outside_the_device_module():
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("cachesmith", "benchmarks", "tests")
             for path in sorted((ROOT / folder).rglob("*.py")) if path != DEVICE_MODULE and path != Path(__file__)
             for n, line in enumerate(path.read_text().splitlines(), 1) if CUDA_CALL.search(line)]
    assert found == []


def test_the_cpu_gets_inert_streams_and_events_and_no_graph():
    cpu = torch.device("cpu")
    stream = accel.new_stream(cpu)
    event = accel.new_event(cpu)
    event.record(stream)
    stream.wait_event(event), stream.wait_stream(accel.current_stream(cpu))
    with accel.on_stream(stream):
        x = torch.ones(2) + 1
    assert x.tolist() == [2.0, 2.0] and event.query() and accel.new_graph(cpu) is None
    assert accel.describe(cpu) == {"cuda": None, "gpu": None} and accel.memory_allocated(cpu) == 0
    assert accel.normalize("cpu") == cpu


def test_pinned_empty_asks_for_page_locked_memory_only_when_told(monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, pin_memory: asked.append(pin_memory))
    accel.pinned_empty((2,), torch.float32, False), accel.pinned_empty((2,), torch.float32, True)
    assert asked == [False, True]


def test_sdpa_kernels_name_none_on_the_cpu():
    q = torch.zeros(1, 2, 3, 8)
    assert accel.sdpa_kernels(q, q, q, None, True, False) is None


def test_torchs_kernel_checks_answer_in_the_payloads_form():
    """The installed torch takes the calls the CUDA backend makes (SDPAParams' seven arguments,
    `_fused_sdp_choice` with enable_gqa); on CPU tensors its answers say nothing of a GPU."""
    q, k = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    got = accel._torch_sdpa_kernels(q, k, k, torch.ones(3, 3, dtype=torch.bool), False, True)
    assert set(got) == {"flash", "efficient", "cudnn", "picked", "reasons"}
    assert got["picked"] in accel.SDPA_KERNEL_NAMES.values() and isinstance(got["reasons"], list)
