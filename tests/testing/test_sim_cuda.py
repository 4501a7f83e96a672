"""The simulated CUDA device itself: it computes what the CPU computes, raises where CUDA raises,
counts what a GPU pays for, and fails the mistakes it exists to catch (the two must-fail cases:
the store reader's old `.numpy()` of a device tensor, and a `.item()` inside the layer loop)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from cachesmith.kvstore import reader as reader_module
from cachesmith.kvstore import staging as staging_module
from cachesmith.model import Decoder, device as accel, prefill_chunk
from cachesmith.model.layers import DecoderLayer
from cachesmith.recompute import BatchRunner, RecomputeRequest, full_reuse
from cachesmith.testing.sim_cuda import SimCuda, SimCudaError, SimTensor

pytestmark = pytest.mark.sim_cuda


def test_device_tensors_hold_the_cpu_values_and_report_cuda(sim_cuda):
    x = torch.arange(6.0, device="cuda").view(2, 3)
    assert isinstance(x, SimTensor) and x.device == torch.device("cuda", 0) and x.is_cuda
    x[:1].add_(10)  # in place through a view, as on a GPU
    x[1:] = 5
    assert torch.equal(x.cpu(), torch.tensor([[10.0, 11, 12], [5, 5, 5]]))
    assert (x * 2).device.type == "cuda" and (x + torch.tensor(1.0)).device.type == "cuda"  # 0-dim host scalar
    host = torch.empty_like(x, device="cpu")
    assert not isinstance(host, SimTensor) and host.device.type == "cpu" and host.shape == x.shape
    assert accel.is_cuda_available() and accel.normalize("cuda") == x.device


def test_a_module_moves_to_the_device(sim_cuda):
    layer = torch.nn.Linear(4, 3)
    expected = layer(torch.ones(2, 4))
    layer.to("cuda")
    assert layer.weight.device.type == "cuda" and torch.equal(layer(torch.ones(2, 4, device="cuda")).cpu(), expected)


@pytest.mark.parametrize("mistake, words", [
    (lambda x: x.numpy(), "numpy"),
    (lambda x: x + torch.ones(2, 3), "one device"),
    (lambda x: torch.cat([x, torch.zeros(1, 3)]), "one device"),
    (lambda x: x.data_ptr(), "device pointer"),
])
def test_it_raises_where_cuda_raises(sim_cuda, mistake, words):
    x = torch.zeros(2, 3, device="cuda")
    with pytest.raises(SimCudaError, match=words):
        mistake(x)


def test_host_syncs_and_copies_are_counted_per_region_and_across_threads(sim_cuda):
    x = torch.ones(4, device="cuda")
    with sim_cuda.count() as counts:
        float(x.sum()), x.tolist(), bool(x.any()), x.nonzero()
        x.cpu()
        torch.ones(4).to("cuda")
        thread = threading.Thread(target=lambda: torch.tensor([1, 2], device="cuda"))
        thread.start(), thread.join()
    assert counts.syncs == 4 and counts.sync_sites == ["__float__", "tolist", "__bool__", "nonzero"]
    assert counts.d2h == 1 and counts.h2d == 2 and counts.ops > 0


def test_pinned_buffers_and_their_views_are_known_and_pageable_async_copies_are_findings(sim_cuda):
    pinned = accel.pinned_empty((8, 2), torch.float32, True)
    assert pinned.is_pinned() and pinned[2:4].is_pinned() and not torch.empty(3).is_pinned()
    with torch.inference_mode():  # inference tensors' views keep no `_base`
        buffer = accel.pinned_empty((8, 2), torch.float32, True)
        assert buffer[2:4].is_pinned() and buffer.view(16)[3:].is_pinned()
    dst = torch.empty(8, 2, device="cuda")
    with sim_cuda.count() as counts:
        dst[:4].copy_(pinned[:4], non_blocking=True)
        dst[4:].copy_(torch.zeros(4, 2), non_blocking=True)
    assert counts.h2d == 2 and len(counts.findings) == 1 and "not pinned" in counts.findings[0]


@pytest.mark.parametrize("mask, gqa, dtype, kernel", [
    # an H100 under torch 2.13's CUDA 13 build tries cuDNN first: it takes half precision, a mask
    # and GQA (`sim_kernels` has the rules and their sources)
    (True, True, torch.bfloat16, "cudnn"),
    (True, False, torch.bfloat16, "cudnn"),
    (False, True, torch.bfloat16, "cudnn"),
    (False, False, torch.float32, "efficient"),
    (True, True, torch.float32, "math"),  # float32 with a mask and enable_gqa: no fused kernel in 2.13
])
def test_it_names_the_attention_kernel_cuda_would_run(sim_cuda, mask, gqa, dtype, kernel):
    q = torch.randn(1, 4, 5, 8, device="cuda", dtype=dtype)
    k = torch.randn(1, 2 if gqa else 4, 5, 8, device="cuda", dtype=dtype)
    with sim_cuda.count() as counts:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=gqa,
                                       attn_mask=torch.ones(5, 5, dtype=torch.bool, device="cuda") if mask else None)
    assert counts.attention == {kernel: 1}


def test_graph_capture_refuses_a_sync_and_replays_into_the_same_buffers(sim_cuda):
    x = torch.zeros(3, device="cuda")
    graph = accel.new_graph(x.device)
    graph.capture(lambda: x.add_(1))
    graph.replay()
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]  # the warm-up and one replay: a capture runs nothing
    with pytest.raises(SimCudaError, match="captured"):
        accel.new_graph(x.device).capture(lambda: int(x.sum()))


def test_it_is_off_outside_its_context():
    with SimCuda():
        x = torch.ones(2, device="cuda")
    assert isinstance(accel.backend(), accel.TorchCuda)  # the real backend is back
    with pytest.raises(SimCudaError, match="outside the simulation"):
        x + 1


# -- the must-fail cases: the simulation catches the mistakes it was built for --------------------

@pytest.fixture(scope="module")
def tiny_model_path(tiny_llama_dir):
    return tiny_llama_dir[0]


def test_the_old_numpy_of_a_device_cache_in_the_store_reader_raises(sim_cuda, tiny_model_path, monkeypatch, tmp_path):
    """The first GPU run crashed here: the reader filled a device cache through `.numpy()`. Put that
    code back (the direct route on CUDA, no host-memory guard) and the simulation must raise."""
    from cachesmith.kvstore import ChunkStore, StoreConfig

    model = Decoder(tiny_model_path, "cuda")
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk = prefill_chunk(model, list(range(3, 70)))
    key = store.put(chunk)
    monkeypatch.setattr(staging_module, "is_staged_for", lambda device, is_staged: False)
    monkeypatch.setattr(reader_module, "_byte_view", lambda t: memoryview(t.numpy()).cast("B"))
    k_dst = torch.empty(chunk.keys.shape[1:], dtype=chunk.keys.dtype, device="cuda")
    v_dst = torch.empty_like(k_dst)
    reader = store.open(key, model)
    with pytest.raises(SimCudaError, match="numpy"):
        staging_module.StagingPath(model.device).batch().load(reader, 0, k_dst, v_dst, None)


def test_a_deliberate_item_in_the_layer_loop_is_counted_and_fails_the_run_budget(sim_cuda, tiny_model_path,
                                                                                  monkeypatch):
    model = Decoder(tiny_model_path, "cuda")
    model.is_prefill_graphed = False  # the eager layer loop, where an item would cost a sync per layer
    request = RecomputeRequest([prefill_chunk(model, list(range(3, 60))), prefill_chunk(model, list(range(5, 50)))],
                               list(range(10, 18)))
    runner = BatchRunner(model)
    runner.run([request], full_reuse())
    with sim_cuda.count() as clean:
        runner.run([request], full_reuse())
    real = DecoderLayer.mlp_block
    monkeypatch.setattr(DecoderLayer, "mlp_block", lambda self, h: real(self, h) if h.sum().item() is not None else h)
    with sim_cuda.count() as dirty:
        runner.run([request], full_reuse())
    assert clean.syncs <= 1
    assert dirty.syncs == clean.syncs + model.num_layers and dirty.sync_sites.count("item") == model.num_layers
