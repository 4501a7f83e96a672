"""The transfer engine: staged runs equal in-memory runs, only reused rows cross the link, the
bandwidth cap and prefetch behave, and faults only slow or recompute."""
from __future__ import annotations

import gc
import time
import weakref
from dataclasses import replace

import pytest
import torch

from cachesmith.errors import ConfigError
from cachesmith.kvstore import ChunkStore, Link, StoredEntry, StoredPrompt, StoreConfig, TransferConfig, TransferEngine, layer_needs
from cachesmith.recompute import BatchRunner, HookChain, RecomputeConfig, RecomputeRequest, RunnerHooks, Signal
from tests.kvstore.helpers import stored_requests
from tests.recompute.helpers import max_diff

PLANS = [RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3), RecomputeConfig(Signal.KV_DEV, 0, 1, 0.3),
         RecomputeConfig(Signal.QCI, 1, 1, 0.3), RecomputeConfig(Signal.QCI_LAST, 0, 3, 0.3),
         RecomputeConfig(Signal.POSITION, 0, 0, 0.3), RecomputeConfig(Signal.QCI, 3, 0, 0.3),
         RecomputeConfig(Signal.FUSED, 1, 2, 0.3)]


@pytest.mark.parametrize("is_staged", [None, True], ids=["route-default", "route-staged"])
@pytest.mark.parametrize("is_prefetch", [True, False])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_staged_batch_equals_in_memory_batch(model, tmp_path, plan, is_prefetch, is_staged):
    """Through the store equals in memory, bit for bit, on the device's route and on the staged
    one (host buffers, then copies: what a GPU runs, walked on CPU too)."""
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    reqs, keyed = stored_requests(model, store)
    ref = BatchRunner(model).run(reqs, plan)
    engine = TransferEngine(store, model, TransferConfig(is_prefetch=is_prefetch, is_staged=is_staged))
    with engine.stage(keyed, plan) as batch:
        out = BatchRunner(model).run(batch.requests, plan, batch)
    for a, b in zip(out, ref):
        assert max_diff(a.logits, b.logits) == 0.0 and torch.equal(a.selected, b.selected)


@pytest.mark.parametrize("is_staged", [None, True], ids=["route-default", "route-staged"])
def test_an_encoded_store_stages_what_it_decodes(model, tmp_path, is_staged):
    """An int8 store through the transfer engine (decoded on the host, or, staged for a device, on
    the device) gives the batch that its decoded chunks give in memory, bit for bit."""
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path, codec="int8"))
    exact, keyed = stored_requests(model, store)
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.15)
    decoded = [RecomputeRequest([store.get(e.key, model) for e in p.chunks], list(p.suffix_ids),
                                store.get(p.prefix.key, model)) for p in keyed]
    ref = BatchRunner(model).run(decoded, plan)
    with TransferEngine(store, model, TransferConfig(is_staged=is_staged)).stage(keyed, plan) as batch:
        out = BatchRunner(model).run(batch.requests, plan, batch)
    for a, b in zip(out, ref):
        assert max_diff(a.logits, b.logits) == 0.0 and torch.equal(a.selected, b.selected)
    assert max_diff(out[0].logits, BatchRunner(model).run(exact[:1], plan)[0].logits) > 0  # lossy, really


def test_patch_layers_move_only_reused_rows(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    reqs, keyed = stored_requests(model, store, seeds=(3,))
    plan = RecomputeConfig(Signal.POSITION, 0, 0, 0.5)  # selection known before any layer
    moved = []

    class Spy(Link):
        def consume(self, nbytes):
            moved.append(nbytes)
            return time.monotonic()

    engine = TransferEngine(store, model)
    engine.link = Spy(None)
    with engine.stage(keyed, plan) as batch:
        out = BatchRunner(model).run(batch.requests, plan, batch)[0]
    row = 2 * model.config.num_kv_heads * model.config.head_dim * 4  # K + V, float32
    # on every device only the reused rows move: the selection is on the host
    assert out.selected.device.type == "cpu"
    reused = 140 - out.selected.numel()
    assert sum(moved) == model.num_layers * (reused + reqs[0].prefix.num_tokens) * row


def test_layer_needs_follow_the_phases():
    L = 30
    assert layer_needs(RecomputeConfig(Signal.KV_DEV, 1, 0, 0.1), L) == ({1}, range(2, 30))
    assert layer_needs(RecomputeConfig(Signal.QCI, 2, 3, 0.1), L) == ({2, 3, 4}, range(2, 30))
    assert layer_needs(RecomputeConfig(Signal.QCI_LAST, 0, 30, 0.1), L) == ({29}, range(0, 30))
    assert layer_needs(RecomputeConfig(Signal.FUSED, 1, 29, 0.1), L) == ({1, 29}, range(2, 30))
    assert layer_needs(RecomputeConfig(Signal.POSITION, 30, 0, 1.0), L) == (set(), range(0))


def test_bandwidth_cap_slows_loads(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    _, keyed = stored_requests(model, store)
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.2)

    def run(cfg):
        engine = TransferEngine(store, model, cfg)
        with engine.stage(keyed, plan) as batch:
            BatchRunner(model).run(batch.requests, plan, batch)
        return batch.stall_s, engine

    _, free = run(TransferConfig())
    # prefetch off: every load is issued when the runner reaches its layer, so the runner waits for
    # each byte on the 0.5 MB/s link (with prefetch, how much hides depends on this machine's speed)
    stall, capped = run(TransferConfig(bandwidth_gbps=0.0005, is_prefetch=False))
    seconds_on_link = capped.stats.bytes_loaded / 0.5e6
    assert stall > 0.8 * seconds_on_link
    assert capped.stats.effective_gbps < 0.001 < free.stats.effective_gbps


class _WarmUpWatch(RunnerHooks):
    """At the end of the WarmUp layers (before the runner asks for any cached KV), waits up to
    `max_wait_s` for the link to have moved `want_bytes`, and records how much it had moved. What
    the assertions read is a byte count, so a busy machine can only make the wait longer."""

    def __init__(self, engine: TransferEngine, last_warmup_layer: int, want_bytes: int, max_wait_s: float) -> None:
        self.engine, self.layer, self.want, self.max_wait_s = engine, last_warmup_layer, want_bytes, max_wait_s
        self.loaded_before: int | None = None

    def after_layer(self, info):
        if info.phase == "warmup" and info.layer == self.layer:
            deadline = time.monotonic() + self.max_wait_s
            while self.engine.stats.bytes_loaded < self.want and time.monotonic() < deadline:
                time.sleep(0.005)
            self.loaded_before = self.engine.stats.bytes_loaded


def test_prefetch_hides_loads_behind_warmup_compute(model, tmp_path):
    """kv_dev with w=2, p=0 on the 3-layer model: the only cached KV read is layer 2's (the scoring
    layer, full KV), known before any layer runs. With prefetch it streams in while layers 0-1 run
    (all of it has crossed the link before layer 2 asks, and the runner then never waits); without,
    nothing is issued until layer 2, and the runner waits for the whole capped load."""
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    _, keyed = stored_requests(model, store)
    plan = RecomputeConfig(Signal.KV_DEV, 2, 0, 0.2)
    link_s = 0.4

    def staged(cfg: TransferConfig, want_bytes: int, max_wait_s: float) -> tuple[float, _WarmUpWatch]:
        engine = TransferEngine(store, model, cfg)
        watch = _WarmUpWatch(engine, 1, want_bytes, max_wait_s)
        with engine.stage(keyed, plan) as batch:
            BatchRunner(model).run(batch.requests, plan, HookChain(batch, watch))
        return batch.stall_s, watch

    _, free = staged(TransferConfig(), 0, 0.0)  # how many bytes the plan moves
    total = free.engine.stats.bytes_loaded
    assert total > 0
    gbps = total / link_s / 1e9
    stall_on, on = staged(TransferConfig(bandwidth_gbps=gbps), total, 60.0)
    stall_off, off = staged(TransferConfig(bandwidth_gbps=gbps, is_prefetch=False), total, 0.2)
    assert on.loaded_before == total and off.loaded_before == 0
    assert stall_off > 0.8 * link_s  # the capped link sleeps: a lower bound however busy the machine
    assert stall_on < 0.25 * stall_off, (stall_on, stall_off)


def test_link_slowed_mid_batch_only_slows_it(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    reqs, keyed = stored_requests(model, store, seeds=(4,))
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
    ref = BatchRunner(model).run(reqs, plan)[0]
    engine = TransferEngine(store, model, TransferConfig(bandwidth_gbps=1.0))

    class SlowDown(RunnerHooks):  # after WarmUp, before the Patch rows are known and loaded
        def after_layer(self, info):
            if info.layer == 0:
                engine.link.set_bandwidth(0.0002)

    with engine.stage(keyed, plan) as batch:
        start = time.perf_counter()
        out = BatchRunner(model).run(batch.requests, plan, HookChain(batch, SlowDown()))[0]
        elapsed = time.perf_counter() - start
    patch_bytes = 2 * 4 * model.config.num_kv_heads * model.config.head_dim * (140 - out.selected.numel())
    assert max_diff(out.logits, ref.logits) == 0.0
    assert elapsed > 0.8 * patch_bytes / 0.0002e9  # the reused rows of the last layer crossed the slow link
    assert engine.stats.effective_gbps < 0.5


def test_corrupt_block_mid_batch_is_recomputed(model, tmp_path, caplog):
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    reqs, keyed = stored_requests(model, store, seeds=(5,))
    plan = RecomputeConfig(Signal.QCI, 0, 2, 0.3)
    ref = BatchRunner(model).run(reqs, plan)[0]
    engine = TransferEngine(store, model)
    with engine.stage(keyed, plan) as batch:  # headers verified; now damage a data block on disk
        path = store.tiers[0].path(keyed[0].chunk_keys[0])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        out = BatchRunner(model).run(batch.requests, plan, batch)[0]
    assert "recomputed" in caplog.text and engine.stats.num_recomputed == 1
    assert max_diff(out.logits, ref.logits) < 1e-5
    assert store.get(keyed[0].chunk_keys[0], model) is not None  # stored anew, intact


def test_missing_chunk_and_bad_config_are_named(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    engine = TransferEngine(store, model)
    with pytest.raises(Exception, match=r"requests\[0\].chunks\[0\]: chunk 0000"):
        engine.stage([StoredPrompt((StoredEntry("0" * 64, 3),), (5, 6))], RecomputeConfig(Signal.KV_DEV, 1, 0, 0.1))
    with pytest.raises(ConfigError, match="bandwidth_gbps"):
        TransferConfig(bandwidth_gbps=0)


def test_an_entry_evicted_between_admission_and_staging_is_prefilled_again(model, tmp_path, caplog):
    """Every tier may drop an admitted request's entry before its batch stages it (a memory LRU, a
    disk quota, redis away): rebuilt from what its caller stored, the batch runs as if nothing left."""
    store = ChunkStore(StoreConfig(tiers=("memory",)))
    reqs, keyed = stored_requests(model, store, seeds=(1,))
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
    ref = BatchRunner(model).run(reqs, plan)
    req, lost = keyed[0], keyed[0].chunk_keys[1]
    store.delete(lost)
    bare = replace(req, chunks=tuple(e._replace(token_ids=None) for e in req.chunks))
    with pytest.raises(Exception, match=r"requests\[0\].chunks\[1\]: chunk"):  # nothing to rebuild it from
        TransferEngine(store, model).stage([bare], plan)
    engine = TransferEngine(store, model)
    with engine.stage(keyed, plan) as batch:
        out = BatchRunner(model).run(batch.requests, plan, batch)
    assert max_diff(out[0].logits, ref[0].logits) == 0.0 and store.contains(lost)
    assert engine.stats.num_recomputed == 1 and "prefilled again" in caplog.text


class _Lower(RunnerHooks):
    """A runtime monitor that drops every recomputed context row after the first Patch layer."""

    def __init__(self):
        self.seen = False

    def after_layer(self, info):
        if info.phase == "patch" and not self.seen:
            self.seen = True
            return {0: 0.0}
        return None


@pytest.mark.parametrize("plan", PLANS[:5], ids=lambda p: p.label())
def test_lowered_coverage_loads_the_rows_it_now_reuses(model, tmp_path, plan):
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    reqs, keyed = stored_requests(model, store, seeds=(6,))
    ref = BatchRunner(model).run(reqs, plan, _Lower())[0]
    engine = TransferEngine(store, model)
    with engine.stage(keyed, plan) as batch:
        out = BatchRunner(model).run(batch.requests, plan, HookChain(batch, _Lower()))[0]
    assert out.selected.numel() == 0
    assert max_diff(out.logits, ref.logits) == 0.0


@pytest.mark.parametrize("final", [RecomputeConfig(Signal.QCI, 1, 2, 0.3), RecomputeConfig(Signal.KV_DEV, 2, 1, 0.3)],
                         ids=lambda p: p.label())
def test_plan_decided_after_layer_0_stages_what_it_needs(model, tmp_path, final):
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    reqs, keyed = stored_requests(model, store)
    ref = BatchRunner(model).run(reqs, final)
    provisional = RecomputeConfig(Signal.POSITION, 1, 0, 0.0)
    engine = TransferEngine(store, model)
    with engine.stage(keyed, provisional) as batch:
        def replan(entropies):
            batch.set_plan(final)
            return final, None
        out = BatchRunner(model).run(batch.requests, provisional, batch, replan=replan)
    for a, b in zip(out, ref):
        assert max_diff(a.logits, b.logits) == 0.0 and torch.equal(a.selected, b.selected)


def test_a_dropped_engine_is_collected_and_its_loader_threads_stop(model, tmp_path):
    """An engine its owner dropped without `close` (a discarded pipeline) must not live on in its
    loader threads, holding the model's weights."""
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    _, keyed = stored_requests(model, store, seeds=(3,))
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
    engine = TransferEngine(store, model)
    with engine.stage(keyed, plan) as batch:
        BatchRunner(model).run(batch.requests, plan, batch)
    threads = list(engine._workers)
    assert threads and all(t.is_alive() for t in threads)
    dropped = weakref.ref(engine)
    del engine, batch
    gc.collect()
    assert dropped() is None
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
