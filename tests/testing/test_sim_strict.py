"""The simulated CUDA device is strict where a first GPU run fails: copies land at their events,
streams are ordered only by waits, a graph replay runs no Python, and device memory has a capacity.
Each rule has a must-fail case on project code where the mistake exists or existed."""
from __future__ import annotations

import logging

import pytest
import torch

from cachesmith.model import Decoder, device as accel, graph_decode
from cachesmith.model.generate import Decoding, _TokenReader
from cachesmith.model.kv_cache import SlabPool
from cachesmith.model.sampling import SamplingParams
from cachesmith.testing.sim_backend import CAPTURE_SYNC
from cachesmith.testing.sim_cuda import SimCuda
from cachesmith.testing.sim_streams import POISON_INT
from tests.model.decoding_runs import run_with_join

pytestmark = pytest.mark.sim_cuda
GIB = 1 << 30


# -- asynchrony -------------------------------------------------------------------------------------

def test_a_non_blocking_copy_to_pinned_memory_lands_at_its_event(sim_cuda):
    x = torch.arange(4.0, device="cuda")
    host = accel.pinned_empty((4,), torch.float32, is_pinned=True)
    with sim_cuda.count() as counts:
        host.copy_(x, non_blocking=True)
        early = host.tolist()  # read before the event: what the memory held
        done = accel.new_event(x.device)
        done.record()
        done.synchronize()
    assert all(v != v for v in early)  # NaN: not landed
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert any("pinned host memory used by the host" in f for f in counts.stream_findings)


def test_the_token_reader_without_its_wait_reads_poison(sim_cuda, monkeypatch):
    """Project code with the wait removed: `_TokenReader.read` would hand back what the pinned
    buffer held, not the step's tokens (on a GPU: stale ids, no error)."""
    ids = torch.tensor([5, 6, 7], device="cuda")
    assert _TokenReader(ids.device).read(ids) == [5, 6, 7]

    class NoWait:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass
    monkeypatch.setattr(accel, "new_event", lambda device: NoWait())
    with sim_cuda.count() as counts:
        assert _TokenReader(ids.device).read(ids) == [POISON_INT] * 3
    assert counts.stream_findings


def test_a_pinned_source_reused_before_its_copy_lands_corrupts_it(sim_cuda):
    src = accel.pinned_empty((3,), torch.float32, is_pinned=True)
    src.copy_(torch.tensor([1.0, 2.0, 3.0]))
    dst = torch.zeros(3, device="cuda")
    side = accel.new_stream(dst.device)
    with accel.on_stream(side):
        dst.copy_(src, non_blocking=True)
    with sim_cuda.count() as counts:
        src.fill_(9.0)  # the host reuses the buffer: the copy has not run yet
    side.synchronize()
    assert dst.cpu().tolist() == [9.0, 9.0, 9.0]  # as a GPU may: the copy read the buffer late
    assert counts.stream_findings


# -- streams ----------------------------------------------------------------------------------------

def test_a_read_on_another_stream_needs_a_wait(sim_cuda):
    x = torch.zeros(4, device="cuda")
    side = accel.new_stream(x.device)
    with sim_cuda.count() as racy:
        with accel.on_stream(side):
            x.add_(1)
        (x * 2).sum()  # the default stream reads what the side stream wrote, with no wait
    assert len(racy.stream_findings) == 1 and "no wait_event" in racy.stream_findings[0]
    with sim_cuda.count() as ordered:
        side.wait_stream(accel.current_stream(x.device))  # the default stream read x just before
        with accel.on_stream(side):
            x.add_(1)
        done = accel.new_event(x.device)
        done.record(side)
        accel.current_stream(x.device).wait_event(done)
        (x * 2).sum()
    assert ordered.stream_findings == []


def test_disjoint_rows_of_one_slab_need_no_wait(sim_cuda):
    """Layer-wise loading: a side stream fills one layer's rows while compute writes another's."""
    slab = torch.zeros(2, 8, device="cuda")
    side = accel.new_stream(slab.device)
    with sim_cuda.count() as counts:
        with accel.on_stream(side):
            slab[0].fill_(1.0)
        slab[1].fill_(2.0)
    assert counts.stream_findings == []


def test_a_slab_handed_back_mid_stream_is_reused_after_its_givers_work(sim_cuda):
    """The pool orders reuse as torch's allocator does: a slab given back on one stream and taken on
    another waits for the giver's work (without the pool's event, the taker's write races it)."""
    pool = SlabPool()
    side = accel.new_stream(torch.device("cuda"))
    slab = pool.take((1, 4, 1, 2), torch.device("cuda"), torch.float32)
    with sim_cuda.count() as counts:
        with accel.on_stream(side):
            slab.mul(2).sum()  # the side stream reads it
            pool.give(slab)
        pool.take((1, 4, 1, 2), torch.device("cuda"), torch.float32).fill_(0.0)  # default stream reuses it
    assert pool.num_reused == 1 and counts.stream_findings == []


# -- graphs -----------------------------------------------------------------------------------------

def test_a_capture_runs_nothing_and_charges_a_sync(sim_cuda):
    x = torch.zeros(3, device="cuda")
    graph = accel.new_graph(x.device)
    with sim_cuda.count() as counts:
        graph.capture(lambda: x.add_(1))
    assert x.cpu().tolist() == [1.0, 1.0, 1.0]  # the warm-up only
    assert (counts.captures, counts.cache_empties, counts.sync_sites) == (1, 1, [CAPTURE_SYNC])
    graph.replay()
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]


def test_a_replay_reads_the_captured_tensor_not_a_rebound_one(sim_cuda):
    class Step:
        def __init__(self):
            self.scale = torch.full((2,), 2.0, device="cuda")
            self.out = torch.zeros(2, device="cuda")

        def __call__(self):
            self.out.copy_(self.scale * 3)
    step = Step()
    graph = accel.new_graph(step.out.device)
    graph.capture(step)
    step.scale = torch.full((2,), 5.0, device="cuda")  # rebound: the graph still holds the old tensor
    graph.replay()
    assert step.out.cpu().tolist() == [6.0, 6.0]


def test_a_bucket_rebinding_its_inputs_is_caught(tiny_llama_dir, monkeypatch):
    """Project code with a mistake a replay hides if it runs Python: `_Bucket.seat` rebinding its
    static inputs to a new tensor instead of copying into them. The graph reads the captured
    buffers, so every step decodes from the padding rows' inputs: the tokens differ from eager."""
    def rebinding_seat(self, gens):
        seat(self, gens)
        self.state = self.state.clone()  # a new tensor: what a fresh `torch.tensor(...)` would be
        self.ids, self.positions, self.live = self.state.unbind(0)
    seat = graph_decode._Bucket.seat
    with SimCuda():
        eager = _tokens(Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"), use_graphs=False))
        assert _tokens(Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"))) == eager
        monkeypatch.setattr(graph_decode._Bucket, "seat", rebinding_seat)
        assert _tokens(Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"))) != eager


def _tokens(decoding: Decoding, params=None) -> list[list[int]]:
    gens, _ = run_with_join(decoding, params)
    for gen in gens:
        gen.cache.release()
    return [g.token_ids for g in gens]


def test_greedy_and_sampled_rows_capture_each_bucket_once(tiny_llama_dir):
    """A sampled row sends its steps eager; the bucket is kept, so greedy steps after it replay
    without a second capture of the same size."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    params = [SamplingParams(), sampled, SamplingParams(), SamplingParams()]
    on_cpu = _tokens(Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32")), params)
    with SimCuda() as sim:
        decoding = Decoding(Decoder(tiny_llama_dir[0], "cuda", "float32"))
        with sim.count() as counts:
            assert _tokens(decoding, params) == on_cpu
            # greedy again, in the buckets the first run captured
            assert _tokens(decoding, [SamplingParams()] * 4) == _tokens(
                Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32")), [SamplingParams()] * 4)
    graphs = decoding.graphs
    sizes = list(graphs._buckets)
    print(f"captures {graphs.num_captures}, buckets {sizes}, replays {graphs.num_replays}")
    assert graphs.num_captures == counts.captures == len(sizes) == len(set(sizes))
    assert graphs.num_replays > graphs.num_captures


# -- memory -----------------------------------------------------------------------------------------

def test_memory_is_counted_and_has_a_capacity():
    with SimCuda(capacity_bytes=1 << 20) as sim:
        free, total = accel.memory_info(torch.device("cuda"))
        assert (free, total) == (1 << 20, 1 << 20)
        x = torch.zeros(1024, device="cuda")  # 4 KiB
        view = x[:10]
        assert accel.memory_allocated(x.device) == 4096 and accel.memory_info(x.device)[0] == (1 << 20) - 4096
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            torch.zeros(1 << 18, device="cuda")  # 1 MiB more
        del x, view
        assert accel.memory_allocated(torch.device("cuda")) == 0 and sim.memory.peak_bytes == 4096


def _bucket_run(tiny_dir, room: int | None = None, max_graph_bytes: int | None = None
                ) -> tuple[Decoding, list[list[int]], list[str], int]:
    """A run needing a 4-row bucket, then (the others done) a 1-row one: (its decoding, tokens,
    log lines, the device bytes the first step's capture took). `room`: device bytes free beside
    what the run holds when its first step starts."""
    with SimCuda() as sim:
        model = Decoder(tiny_dir, "cuda", "float32")
        model.max_graph_bytes = max_graph_bytes
        decoding = Decoding(model)
        messages: list[str] = []
        first = []

        def on_step(step: int, dec: Decoding) -> None:
            if step == 0 and room is not None:
                sim.memory.capacity_bytes = sim.memory.live_bytes + room
            before = sim.memory.live_bytes
            dec.step()
            if step == 0:
                first.append(sim.memory.live_bytes - before)
        handler = _Collect(messages)
        logging.getLogger(graph_decode.__name__).addHandler(handler)
        try:
            gens, _ = run_with_join(decoding, [SamplingParams()] * 4, on_step, budgets=[6, 6, 6, 6])
        finally:
            logging.getLogger(graph_decode.__name__).removeHandler(handler)
        tokens = [g.token_ids for g in gens]
        for gen in gens:
            gen.cache.release()
    return decoding, tokens, messages, first[0]


class _Collect(logging.Handler):
    def __init__(self, out: list[str]) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


def test_a_new_bucket_is_allocated_after_the_old_is_freed(tiny_llama_dir):
    """Room for the 4-row bucket (its slabs and its graph's own memory) and a little more, but not
    for the 1-row bucket beside it: the mistake of capturing the new bucket while the old one is
    alive is an out-of-memory error mid-serving (at the 8B shape: two 34 GB buckets on 80 GiB)."""
    free_run, eager, _, first_capture = _bucket_run(tiny_llama_dir[0])
    assert free_run.graphs.num_captures == 2 and len(free_run.graphs._buckets) == 2  # kept while room allows
    with SimCuda():
        model = Decoder(tiny_llama_dir[0], "cuda", "float32")
    slack = graph_decode.bucket_bytes(model, 1, graph_decode.MIN_LENGTH_BUCKET) * 4 // 5  # less than one more bucket
    decoding, tokens, messages, _ = _bucket_run(tiny_llama_dir[0], room=first_capture + slack)
    assert tokens == eager and messages == []
    assert decoding.graphs.num_captures == 2 and list(decoding.graphs._buckets) == [(1, 64)]  # the 4-row one freed


def test_a_bucket_past_the_graph_budget_runs_eager_and_says_so_once(tiny_llama_dir):
    _, graphed, _, _ = _bucket_run(tiny_llama_dir[0])
    decoding, tokens, messages, _ = _bucket_run(tiny_llama_dir[0], max_graph_bytes=1)
    assert tokens == graphed
    assert (decoding.graphs.num_captures, decoding.graphs.num_replays) == (0, 0)
    assert len(messages) == 2 and all("run eager" in m for m in messages)  # once per size: 4 rows, 1 row
    assert "budget for graphs" in messages[0]


# -- kernel choice ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, is_masked, is_expanded", [
    (torch.bfloat16, True, False),  # cuDNN takes a mask with GQA: no copy of K/V per query head
    (torch.bfloat16, False, False),
    (torch.float32, True, True),  # torch 2.13: no fused kernel for float32 masked GQA, so expand
])
def test_kv_heads_are_expanded_only_where_no_fused_kernel_takes_gqa(sim_cuda, dtype, is_masked, is_expanded):
    from cachesmith.model.layers import _needs_expanded_heads
    q = torch.zeros(5, 4, 16, dtype=dtype, device="cuda")  # [T, H, D]
    k = torch.zeros(5, 2, 16, dtype=dtype, device="cuda")  # [T, Hkv, D]
    mask = torch.ones(5, 5, dtype=torch.bool, device="cuda") if is_masked else None
    assert _needs_expanded_heads(q, k, mask, not is_masked) == is_expanded
    assert not _needs_expanded_heads(q.cpu(), k.cpu(), None if mask is None else mask.cpu(), False)  # CPU: enable_gqa
