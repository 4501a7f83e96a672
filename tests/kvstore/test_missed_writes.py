"""Writes a tier missed reach it once it is back, without waiting for the entry's next read, and
after a restart on the same disk."""
from __future__ import annotations

import threading
import time

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.store import MISSED_WRITES_JOURNAL
from cachesmith.kvstore.missed_writes import MissedWrites, WriteRetrier
from cachesmith.kvstore.disk_tier import DiskTier
from cachesmith.kvstore.tiers import MemoryTier
from cachesmith.model import prefill_chunk
from tests.kvstore.test_store import _Flaky, _ids


class _Counting(MemoryTier):
    """A local tier that counts the entries read from it."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.num_reads = 0

    def source(self, key):
        self.num_reads += 1
        return super().source(key)


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_pass_writes_what_a_tier_missed_once_it_is_back_and_reads_nothing_while_away(model):
    local, flaky = _Counting(), _Flaky()
    store = ChunkStore(StoreConfig(retry_interval_s=3600), tiers=[local, flaky])
    flaky.is_down = True
    keys = [store.put(prefill_chunk(model, _ids(seed=s))) for s in range(3)]
    assert not any(flaky.contains(k) for k in keys)
    reads = local.num_reads
    assert store.retry_missed_writes() == 0 and local.num_reads == reads  # still away: nothing read
    flaky.is_down = False
    assert store.retry_missed_writes() == 3
    assert all(flaky.source(k).size == local.source(k).size for k in keys)
    assert store.retry_missed_writes() == 0 and local.num_reads == reads + 3 + 3  # done: nothing left to read
    store.close()


def test_a_missed_write_whose_entry_is_gone_everywhere_is_dropped(model):
    local, flaky = MemoryTier(1 << 30), _Flaky()
    store = ChunkStore(StoreConfig(retry_interval_s=3600), tiers=[local, flaky])
    flaky.is_down = True
    key = store.put(prefill_chunk(model, _ids()))
    local.delete(key)  # evicted from the one tier that held it
    flaky.is_down = False
    assert store.retry_missed_writes() == 0 and not flaky.contains(key) and len(store._missed) == 0
    store.close()


def test_the_retrier_runs_only_while_writes_are_missed(model):
    local, flaky = MemoryTier(1 << 30), _Flaky()
    store = ChunkStore(StoreConfig(retry_interval_s=0.02), tiers=[local, flaky])
    store.put(prefill_chunk(model, _ids(seed=9)))
    assert not store._retrier.is_running  # every tier kept up: no thread
    flaky.is_down = True
    key = store.put(prefill_chunk(model, _ids()))
    assert store._retrier.is_running
    time.sleep(0.1)
    assert not flaky.contains(key) and store._retrier.is_running  # away: it keeps trying
    flaky.is_down = False
    assert _wait_for(lambda: flaky.contains(key)), "the entry never reached the tier that came back"
    assert _wait_for(lambda: not store._retrier.is_running), "the retrier kept running with nothing missed"
    store.close()


def test_a_quiet_pass_backs_off_and_a_closed_retrier_starts_no_thread():
    passes, pending = [], threading.Event()
    pending.set()
    retrier = WriteRetrier(lambda: passes.append(time.monotonic()) or 0, pending.is_set, 0.01)
    retrier.wake()
    assert _wait_for(lambda: len(passes) >= 5)
    gaps = [b - a for a, b in zip(passes, passes[1:5])]
    assert gaps[-1] > 2 * gaps[0]  # doubling from 0.01 s: 0.02, 0.04, 0.08 ...
    pending.clear()
    assert _wait_for(lambda: not retrier.is_running, 3.0)
    retrier.close()
    retrier.wake()
    assert not retrier.is_running


def test_missed_writes_keep_the_most_recent():
    missed, tier = MissedWrites(), MemoryTier(1)
    for i in range(MissedWrites.MAX_MISSED + 2):
        missed.note(f"{i:064x}", [tier])
    keys = [k for k, _ in missed.items()]
    assert len(missed) == MissedWrites.MAX_MISSED
    assert keys[0] == f"{2:064x}" and keys[-1] == f"{MissedWrites.MAX_MISSED + 1:064x}"  # the oldest two forgotten
    missed.note(keys[0], [])
    assert len(missed) == MissedWrites.MAX_MISSED - 1 and missed.tiers_of(keys[0]) == []


def test_a_restarted_store_on_the_same_disk_still_writes_back_what_it_missed(model, tmp_path):
    flaky = _Flaky()
    config = StoreConfig(tiers=("memory", "disk"), root=tmp_path / "kv", retry_interval_s=3600)
    first = ChunkStore(config, tiers=[MemoryTier(1 << 30), DiskTier(tmp_path / "kv"), flaky])
    flaky.is_down = True
    keys = [first.put(prefill_chunk(model, _ids(seed=s))) for s in range(2)]
    journal = tmp_path / "kv" / MISSED_WRITES_JOURNAL
    assert journal.read_text().split() == [keys[0], "redis", keys[1], "redis"]
    del first  # killed: never closed, its list in memory gone
    flaky.is_down = False
    second = ChunkStore(config, tiers=[MemoryTier(1 << 30), DiskTier(tmp_path / "kv"), flaky])
    assert [k for k, _ in second._missed.items()] == keys and second._retrier.is_running
    assert second.retry_missed_writes() == 2 and all(flaky.contains(k) for k in keys)  # read from its disk
    assert not journal.exists()  # nothing left missed
    second.close()


def test_the_journal_records_changes_only_and_skips_a_cut_line(tmp_path):
    tier, journal = _Flaky(), tmp_path / "missed.log"
    missed = MissedWrites(journal, [tier])
    missed.note("a" * 64, [])  # stored everywhere: nothing to record
    assert not journal.exists()
    missed.note("a" * 64, [tier])
    missed.note("a" * 64, [tier], is_retry=True)  # unchanged: not appended again
    missed.forget("b" * 64)  # never missed: nothing to record
    missed.note("c" * 64, [tier])
    missed.forget("a" * 64)
    assert journal.read_text().splitlines() == ["a" * 64 + " redis", "c" * 64 + " redis", "a" * 64 + " "]
    with journal.open("a") as f:
        f.write("d" * 20)  # a kill mid-line
    assert [k for k, _ in MissedWrites(journal, [tier]).items()] == ["c" * 64]
    assert MissedWrites(journal, []).items() == []  # a tier no longer configured is not waited for
