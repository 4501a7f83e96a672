"""The disk tier's quota: LRU eviction before writes, entries in use never evicted, oversized entries
refused, the startup scan, files other processes removed, and concurrent loaders."""
from __future__ import annotations

import os
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from cachesmith.kvstore import ChunkStore, StoreConfig, disk_quota
from cachesmith.kvstore.reader import read_bytes
from cachesmith.kvstore.disk_tier import DiskTier
from cachesmith.model import prefill_chunk


def _key(i: int) -> str:
    return f"{i:064x}"


def _data(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


def _bytes_on_disk(root) -> int:
    return sum(p.stat().st_size for p in root.glob("*/*") if p.is_file())


def _read(tier: DiskTier, i: int) -> bytes | None:
    source = tier.source(_key(i))
    if source is None:
        return None
    try:
        return read_bytes(source, 0, source.size)
    finally:
        source.close()


def test_quota_evicts_least_recently_used_and_never_exceeds_it(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1000)  # ten 100-byte entries
    for i in range(10):
        assert tier.put(_key(i), _data(i))
    for i in (0, 1, 2):  # read: now the most recently used
        assert _read(tier, i) == _data(i)
    for i in range(10, 20):
        assert tier.put(_key(i), _data(i))
        assert _bytes_on_disk(tmp_path) <= 1000 and tier.usage().num_bytes == _bytes_on_disk(tmp_path)
        if i < 17:  # 3..9 (never read) go first
            assert all(tier.contains(_key(k)) for k in (0, 1, 2))
    assert sorted(tier.keys()) == [_key(i) for i in range(10, 20)]
    assert tier.usage().num_entries == 10 and tier.quota.num_evicted == 10


def test_rewriting_a_stored_key_evicts_nothing_and_writes_nothing(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=300)
    for i in range(3):
        tier.put(_key(i), _data(i))
    written = tier.path(_key(0)).stat().st_mtime_ns
    assert tier.put(_key(0), _data(0))  # its bytes are there already (content-addressed)
    assert tier.path(_key(0)).stat().st_mtime_ns == written
    assert tier.usage().num_entries == 3 and tier.quota.num_evicted == 0


def test_a_replacing_write_has_room_for_its_new_file_beside_the_old(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=301)
    for i in range(3):
        tier.put(_key(i), _data(i))
    tier.quota.touch(_key(0), 100)  # 1 is now the least recently used
    grown = _data(0) + b"x"  # a different size: the file is written anew, beside the old until its rename
    num_reserved = tier.quota.reserve(_key(0), len(grown))
    assert num_reserved == len(grown) and not tier.contains(_key(1))  # room made for the whole new file
    assert tier.contains(_key(2)) and tier.quota.num_bytes + tier.quota.num_reserved <= 301
    tier.quota.commit(_key(0), len(grown), num_reserved)
    assert tier.quota.num_bytes == 100 + len(grown) and tier.quota.num_reserved == 0


def test_an_entry_in_use_is_never_evicted_and_is_evictable_after_close(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=300)
    tier.put(_key(0), _data(0))
    source = tier.source(_key(0))  # a loader thread reading entry 0, the least recently used...
    tier.put(_key(1), _data(1))
    tier.put(_key(2), _data(2))
    _read(tier, 1), _read(tier, 2)  # ...and then the oldest by access too
    for i in range(3, 8):
        assert tier.put(_key(i), _data(i))
        assert tier.contains(_key(0)) and _bytes_on_disk(tmp_path) <= 300
    assert read_bytes(source, 0, source.size) == _data(0) and tier.quota.is_pinned(_key(0))
    source.close()
    assert not tier.quota.is_pinned(_key(0))
    tier.put(_key(8), _data(8))
    assert not tier.contains(_key(0)) and _bytes_on_disk(tmp_path) <= 300


def test_a_reader_from_the_store_pins_its_entry(model, tmp_path):
    ids = [torch.randint(3, 120, (70,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    chunks = [prefill_chunk(model, i) for i in ids]
    probe = ChunkStore(StoreConfig(tiers=("memory",)))
    size = len(probe.tiers[0]._entries[probe.put(chunks[0])])
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path, disk_max_bytes=int(2.5 * size)))
    first = store.put(chunks[0])
    reader = store.open(first, model)  # pinned until closed
    keys = [store.put(c) for c in chunks[1:]]
    assert store.contains(first) and not store.contains(keys[0])  # the next oldest went instead
    assert torch.equal(reader.read_chunk().keys, chunks[0].keys.cpu())
    reader.close()
    store.put(chunks[1])
    assert not store.contains(first) and _bytes_on_disk(tmp_path) <= 2.5 * size


def test_a_put_that_only_entries_in_use_could_make_room_for_is_refused(tmp_path, caplog):
    tier = DiskTier(tmp_path, max_bytes=250)
    tier.put(_key(0), _data(0))
    tier.put(_key(1), _data(1))
    sources = [tier.source(_key(0)), tier.source(_key(1))]
    assert not tier.put(_key(2), _data(2))
    assert "entries in use" in caplog.text and "disk_max_bytes=250" in caplog.text
    assert tier.keys() == [_key(0), _key(1)] and tier.usage().num_bytes == 200
    for source in sources:
        source.close()
    assert tier.put(_key(2), _data(2)) and not tier.contains(_key(0))


def test_an_entry_larger_than_the_quota_is_refused_and_the_tier_stays_readable(tmp_path, caplog):
    tier = DiskTier(tmp_path, max_bytes=250)
    tier.put(_key(0), _data(0))
    assert not tier.put(_key(1), _data(1, size=251))
    assert "251 bytes is larger than the whole quota (disk_max_bytes=250)" in caplog.text
    assert _read(tier, 0) == _data(0) and not tier.contains(_key(1))
    assert tier.usage().num_bytes == 100 == _bytes_on_disk(tmp_path)  # no temp file left either
    assert tier.put(_key(2), _data(2)) and tier.usage().num_entries == 2


def test_the_startup_scan_counts_entries_in_their_access_order(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    now = time.time()
    for i in range(3):
        tier.put(_key(i), _data(i, size=100 + i))
        os.utime(tier.path(_key(i)), (now - 3600 * (3 - i),) * 2)  # written 3, 2 and 1 hours ago
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.cskv").write_bytes(b"not an entry")  # never counted, never evicted
    assert _read(DiskTier(tmp_path), 0) == _data(0)  # a read moves entry 0's atime to now
    again = DiskTier(tmp_path, max_bytes=303)
    usage = again.usage()
    assert (usage.num_entries, usage.num_bytes, usage.max_bytes) == (3, 303, 303)
    assert usage.oldest_access == pytest.approx(now - 7200, abs=1)  # entry 1's
    again.put(_key(3), _data(3, size=100))  # needs 100 bytes: entry 1 (101) frees them
    assert not again.contains(_key(1)) and again.contains(_key(0)) and again.contains(_key(2))
    assert (tmp_path / "ab" / "notes.cskv").exists()


def test_the_default_quota_is_half_of_free_plus_stored_space(tmp_path, monkeypatch):
    DiskTier(tmp_path).put(_key(0), _data(0, size=4096))
    free = types.SimpleNamespace(f_bavail=1000, f_frsize=4096)  # a fixed 4096000 bytes free
    monkeypatch.setattr(disk_quota.os, "statvfs", lambda root: free)
    tier = DiskTier(tmp_path)
    assert tier.is_default_quota and tier.usage().max_bytes == (4096000 + 4096) // 2
    assert disk_quota.default_max_bytes(tmp_path, 0, fraction=0.25) == 1024000
    assert DiskTier(tmp_path, 0).usage().max_bytes == tier.usage().max_bytes  # 0: the default too


def test_files_another_process_removed_are_forgotten_harmlessly(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=300)
    for i in range(3):
        tier.put(_key(i), _data(i))
    tier.path(_key(0)).unlink()  # another process evicted it (or `store prune` ran)
    assert tier.put(_key(3), _data(3))  # evicting the missing file is no error
    tier.path(_key(1)).unlink()
    assert tier.source(_key(1)) is None  # a read miss forgets it
    assert tier.usage().num_bytes == _bytes_on_disk(tmp_path) == 200


def test_concurrent_loaders_and_writers_stay_within_the_quota(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=2000)
    errors = []

    def work(worker: int) -> None:
        try:
            for n in range(60):
                i = (worker * 7 + n) % 40
                tier.put(_key(i), _data(i))
                got = _read(tier, (i + 3) % 40)
                assert got is None or got == _data((i + 3) % 40)
        except Exception as exc:  # surfaced below: a thread's assert would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.usage().num_bytes == _bytes_on_disk(tmp_path) <= 2000
    assert tier.quota.num_reserved == 0 and not tier.quota._pins


def test_reads_move_the_files_atime_at_most_once_a_minute(tmp_path, monkeypatch):
    from cachesmith.kvstore.sources import FileSource

    DiskTier(tmp_path).put(_key(0), _data(0))
    path, two_hours_ago = DiskTier(tmp_path).path(_key(0)), time.time() - 7200
    os.utime(path, (two_hours_ago, two_hours_ago))
    tier = DiskTier(tmp_path)
    touch, calls = FileSource.touch_atime, []
    monkeypatch.setattr(FileSource, "touch_atime", lambda self: calls.append(1) or touch(self))
    for _ in range(3):
        assert _read(tier, 0) == _data(0)
    assert len(calls) == 1  # the first read only: the next ones come within TOUCH_INTERVAL_S
    st = path.stat()
    assert st.st_atime == pytest.approx(time.time(), abs=5) and st.st_mtime == pytest.approx(two_hours_ago)
    clock = [time.time()]
    monkeypatch.setattr(disk_quota, "time", types.SimpleNamespace(time=lambda: clock[0]))
    for _ in range(4):  # a hot entry, read every 30 s: its atime still moves once a minute
        clock[0] += 30
        _read(tier, 0)
    assert len(calls) == 3


def test_a_write_into_a_folder_gone_read_only_is_refused_not_raised(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, max_bytes=300)
    tier.put(_key(0), _data(0))

    def denied(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", denied)  # the rename into a read-only folder fails...
    monkeypatch.setattr(Path, "unlink", denied)  # ...and so does removing the temporary file
    assert tier.put(_key(1), _data(1)) is False
    assert not tier.contains(_key(1)) and tier.contains(_key(0))
    stranded = list(tmp_path.glob("*/.*.tmp"))
    assert len(stranded) == 1  # still on disk, so its bytes are still counted against the quota
    assert tier.quota.num_reserved == len(_data(1)) == stranded[0].stat().st_size
    monkeypatch.undo()  # the folder is writable again: the next put removes it and gives its room back
    assert tier.put(_key(2), _data(2)) is True
    assert not list(tmp_path.glob("*/.*.tmp")) and tier.quota.num_reserved == 0


def test_a_temporary_file_left_by_a_read_only_folder_counts_until_removed(tmp_path, monkeypatch):
    """The files on disk stay within the quota even while a failed write's temporary file cannot be
    removed: the next write evicts as if that file were an entry."""
    tier = DiskTier(tmp_path, max_bytes=3 * len(_data(0)))
    tier.put(_key(0), _data(0))

    def denied(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", denied)
        m.setattr(Path, "unlink", denied)
        assert tier.put(_key(1), _data(1)) is False
    unlink = Path.unlink

    def tmp_kept(self, *args, **kwargs):  # the temporary file's folder is still read-only
        if self.name.endswith(".tmp"):
            raise PermissionError(1, "Operation not permitted")
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", tmp_kept)
    for i in (2, 3):
        assert tier.put(_key(i), _data(i)) is True
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*/*") if f.is_file())
    assert on_disk <= tier.quota.max_bytes and not tier.contains(_key(0))  # evicted for the stranded bytes
