"""The simulated device's timed mode (`cachesmith/testing/sim_clock.py`): a kernel takes its roofline
time, a call its host cost, a view nothing on the device, a replay one launch, and a sync joins the
host to the streams; a stretch of recorded work is timed again on another GPU without running it."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import device as accel
from cachesmith.testing.sim_clock import H100, H200, SimClock, Timing, time_events
from cachesmith.testing.sim_cuda import SimCuda

SPEC = H100.with_fit(compute_efficiency=0.5, memory_efficiency=0.5, host_call_s=10e-6)

pytestmark = pytest.mark.sim_cuda


@pytest.fixture()
def clock():
    clock = SimClock(SPEC)
    with SimCuda(clock=clock):
        yield clock


def timed(clock: SimClock, run) -> Timing:
    return time_events(clock.record(run), clock.spec)


def test_a_matmul_takes_its_flops_at_the_efficient_peak(clock):
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    t = timed(clock, lambda: a @ b)
    flops = 2 * 2048 ** 3
    assert t.compute_s == pytest.approx(flops / (SPEC.peak_flops * 0.5))
    assert (t.num_calls, t.num_kernels, t.memory_s, t.binding) == (1, 1, 0.0, "compute")
    assert t.elapsed_s == pytest.approx(SPEC.host_call_s + t.compute_s)


def test_a_copy_takes_its_bytes_at_the_efficient_bandwidth_and_a_view_only_host_time(clock):
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.empty_like(x)
    copy = timed(clock, lambda: y.copy_(x))
    assert copy.memory_s == pytest.approx(2 * x.numel() * 4 / (SPEC.bandwidth * 0.5))
    view = timed(clock, lambda: x.view(-1).transpose(0, 0))
    assert (view.num_calls, view.num_kernels) == (2, 0)
    assert view.elapsed_s == pytest.approx(2 * SPEC.host_call_s)


def test_a_slice_and_an_allocation_launch_nothing_and_an_augmented_assignment_writes(clock):
    """`x[:, :n]` and `x[1]` are views (their dunder name ends in "_" like an in-place op's, and
    must not read as one); `torch.empty` only allocates; `y += x` is in place and moves bytes."""
    x = torch.randn(64, 1024, device="cuda")
    sliced = timed(clock, lambda: (x[:, :512], x[1], torch.empty(1 << 20, device="cuda"), torch.empty_like(x)))
    assert (sliced.num_calls, sliced.num_kernels, sliced.memory_s) == (4, 0, 0.0)
    y = torch.zeros_like(x)

    def add():
        nonlocal y
        y += x
    added = timed(clock, add)
    assert added.num_kernels == 1 and added.memory_s > 0


def test_an_indexed_read_moves_its_rows_not_the_table(clock):
    table = torch.randn(50_000, 1024, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(8, device="cuda")
    t = timed(clock, lambda: table[ids])
    assert t.memory_s == pytest.approx(max(2 * 8 * 1024 * 2 / (SPEC.bandwidth * 0.5), SPEC.min_kernel_s))


def test_causal_attention_counts_half_the_square():
    q, out = torch.zeros(1, 8, 512, 64), torch.zeros(1, 8, 512, 64)
    full = SimClock.work("scaled_dot_product_attention", (q, q, q), {}, out)[0]
    causal = SimClock.work("scaled_dot_product_attention", (q, q, q), {"is_causal": True}, out)[0]
    assert full == 4 * 8 * 512 * 512 * 64 and causal == full / 2
    assert SimClock.work("linear", (torch.zeros(3, 16), torch.zeros(32, 16)), {}, torch.zeros(3, 32))[0] == 2 * 3 * 32 * 16


def test_a_replay_costs_one_launch_and_a_sync_waits_for_its_kernels(clock):
    x = torch.zeros(1 << 20, device="cuda")
    graph = accel.new_graph(torch.device("cuda"))

    def steps():
        for _ in range(50):
            x.add_(1)
    graph.capture(steps)
    eager = timed(clock, steps)
    replayed = timed(clock, graph.replay)
    assert (eager.num_calls, replayed.num_calls) == (50, 1)
    assert eager.num_kernels == replayed.num_kernels == 50
    assert replayed.host_s == pytest.approx(SPEC.host_call_s)
    assert replayed.elapsed_s == pytest.approx(SPEC.host_call_s + replayed.memory_s)  # the host waited
    assert float(x[0]) == 150  # the capture's warm-up run (as torch's), the eager steps and the replay


def test_recorded_work_is_timed_on_another_gpu_without_running_it(clock):
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = clock.mark()
    x.mul_(2)
    clock.sync()
    on_h100, on_h200 = (time_events(clock.events[start:], spec.with_fit(memory_efficiency=0.5)) for spec in (H100, H200))
    assert on_h100.memory_s / on_h200.memory_s == pytest.approx(H200.bandwidth / H100.bandwidth)


def test_scaled_adds_the_difference_per_further_layer():
    two, three = Timing(10.0, 1.0, 6.0, 3.0, 0.0, 20, 30), Timing(13.0, 1.0, 8.0, 4.0, 0.0, 20, 40)
    at_32 = two.scaled(three, 30)
    assert (at_32.elapsed_s, at_32.compute_s, at_32.num_kernels, at_32.num_calls) == (100.0, 66.0, 330, 20)
    assert at_32.binding == "compute"
