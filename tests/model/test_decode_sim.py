"""Decoding on the simulated CUDA device: the CPU's tokens, and steps a CUDA graph could capture.

A step after the first of a set of sequences must copy nothing to the device and read nothing back
while its device work runs (issue 61, item 3); its tokens come back to the host once, in one copy
and one wait. Sequences joining or leaving, and rows sampled on the host, rebuild the inputs once.
"""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import Decoder
from cachesmith.model.generate import Decoding
from cachesmith.model.sampling import SamplingParams
from cachesmith.testing.sim_cuda import SimCuda
from tests.model.decoding_runs import JOIN_AT, NUM_TOKENS, run_with_join

pytestmark = pytest.mark.sim_cuda

def _decode(model: Decoder, params: list[SamplingParams], on_step=None,
            use_graphs: bool | None = None) -> list[list[int]]:
    """Tokens of the shared run (`decoding_runs.run_with_join`); the caches released after."""
    gens, _ = run_with_join(Decoding(model, use_graphs), params, on_step)
    for gen in gens:
        gen.cache.release()
    return [g.token_ids for g in gens]


@pytest.mark.parametrize("use_graphs", [True, False])
def test_bfloat16_greedy_tokens_equal_the_cpu_ones(tiny_llama_dir, use_graphs):
    """The simulated device computes on the CPU, so even bfloat16 gives the CPU's tokens exactly (a
    GPU's bfloat16 kernels round otherwise; float32 on every device: test_decode_devices.py)."""
    path, _ = tiny_llama_dir
    params = [SamplingParams()] * 4
    on_cpu = _decode(Decoder(path, "cpu", "bfloat16"), params)
    with SimCuda():
        on_sim = _decode(Decoder(path, "cuda", "bfloat16"), params, use_graphs=use_graphs)
    assert on_sim == on_cpu
    assert [len(t) for t in on_cpu] == [NUM_TOKENS, NUM_TOKENS // 2, NUM_TOKENS, NUM_TOKENS]


def test_steady_steps_neither_sync_nor_copy_in(tiny_llama_dir, sim_cuda, monkeypatch):
    """The eager path (graphs off; graph steps: test_graph_decode.py): each step's device part under
    the sim's capture rules (a sync or a host copy raises) and counted; the whole step: one copy
    back and one wait, plus one rebuild where the rows changed."""
    model = Decoder(tiny_llama_dir[0], "cuda", "bfloat16")
    launches, steps = [], []
    launch = Decoding._launch

    def captured(self, inputs):
        with sim_cuda.count() as c, sim_cuda.capturing():
            out = launch(self, inputs)
        launches.append(c)
        return out
    monkeypatch.setattr(Decoding, "_launch", captured)

    def on_step(step: int, decoding: Decoding) -> None:
        rows = list(decoding.active)
        with sim_cuda.count() as c:
            decoding.step()
        steps.append((step, rows, c))

    _decode(model, [SamplingParams()] * 4, on_step, use_graphs=False)
    assert len(launches) == len(steps) == JOIN_AT + NUM_TOKENS - 1  # until the joiner's last
    for c in launches:
        assert (c.syncs, c.h2d, c.d2h, c.findings) == (0, 0, 0, [])
    previous = None
    for step, rows, c in steps:
        is_rebuilt = rows != previous  # first step, a sequence joined or one left
        assert (c.h2d, c.d2h, c.syncs, c.findings) == (int(is_rebuilt), 1, 1, []), (step, c)
        assert c.sync_sites == ["event.synchronize"]
        previous = rows
    rows_by_step = [rows for _, rows, _ in steps]
    assert sum(a != b for a, b in zip(rows_by_step, [None] + rows_by_step)) == 4  # start, join, 2 leaves


def test_sampled_rows_go_through_the_host(tiny_llama_dir):
    """A seeded sampled row and a greedy row with log-probabilities beside plain greedy rows: each
    row's tokens are the CPU's (they are chosen by their own `Sampler`, the inputs rebuilt after)."""
    path, _ = tiny_llama_dir
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(num_logprobs=2), SamplingParams()]
    on_cpu = _decode(Decoder(path, "cpu", "float32"), params)
    with SimCuda():
        on_sim = _decode(Decoder(path, "cuda", "float32"), params)
    assert on_sim == on_cpu


def test_device_positions_rotate_as_host_ones_without_a_read(tiny_llama_dir, sim_cuda):
    on_cpu = Decoder(tiny_llama_dir[0], "cpu", "float32").rope.cos_sin(torch.tensor([9, 3, 200]))
    rope = Decoder(tiny_llama_dir[0], "cuda", "float32").rope
    positions = torch.tensor([9, 3, 200], device="cuda")
    with sim_cuda.count() as c:
        on_device = rope.cos_sin_at(positions, 201)
    assert (c.syncs, c.h2d, c.d2h) == (0, 0, 0)
    for a, b in zip(on_device, on_cpu):
        assert torch.equal(a.cpu(), b)
