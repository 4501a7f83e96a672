"""The tiered store: read-through with fill, eviction of bad entries, recompute on a miss."""
from __future__ import annotations

import os
import dataclasses

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.tiers import MemoryTier
from cachesmith.kvstore.entry_format import serialize
from cachesmith.kvstore.keys import chunk_key, dtype_name, namespace_of
from cachesmith.model import Decoder, prefill_chunk


def _ids(n=120, seed=0):
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_read_through_fills_faster_tiers(model, tmp_path):
    disk_only = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk = prefill_chunk(model, _ids())
    key = disk_only.put(chunk)
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path))
    assert not store.tiers[0].contains(key)
    got = store.get(key, model)
    assert torch.equal(got.keys, chunk.keys) and got.token_ids == chunk.token_ids
    assert store.tiers[0].contains(key) and store.stats.hits["disk"] == 1
    store.get(key, model)
    assert store.stats.hits["memory"] == 1


def test_demote_drops_only_a_copy_a_slower_tier_keeps(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path))
    key = store.put(prefill_chunk(model, _ids()))
    assert store.demote(key) and not store.tiers[0].contains(key) and store.tiers[1].contains(key)
    assert not store.demote(key)  # nothing left to drop
    store.get(key, model)
    assert store.stats.hits["disk"] == 1 and store.tiers[0].contains(key)  # read from disk, memory filled again
    memory_only = ChunkStore(StoreConfig(tiers=("memory",)))
    only = memory_only.put(prefill_chunk(model, _ids(seed=1)))
    assert not memory_only.demote(only) and memory_only.contains(only)  # its one copy stays


def test_ensure_computes_once_and_keys_by_model_dtype_tokens(model, tmp_path):
    store = ChunkStore(StoreConfig(root=tmp_path))
    key, computed = store.ensure(model, _ids())
    assert computed and store.ensure(model, _ids()) == (key, False)
    assert store.key_for(model, _ids(seed=1)) != key
    low = Decoder(model.model_dir, dtype="bfloat16")
    assert store.key_for(low, _ids()) != key


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_bad_entries_are_evicted_and_recomputed(model, tmp_path, damage, caplog):
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk = prefill_chunk(model, _ids())
    key = store.put(chunk)
    path = store.tiers[0].path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # a well-formed entry for another model, stored under this key
        alien = dataclasses.replace(chunk, model_fingerprint="0" * 32)
        data = bytearray(serialize(key, alien.model_fingerprint, alien.token_ids, alien.keys, alien.values))
    path.write_bytes(bytes(data))
    assert store.get(key, model) is None
    assert "evicted" in caplog.text and not path.exists() and store.stats.evicted_corrupt == 1
    key2, computed = store.ensure(model, _ids())
    assert key2 == key and computed and torch.equal(store.get(key, model).values, chunk.values)


def test_a_namespace_keys_apart_and_its_header_is_verified(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    acme, globex = namespace_of("acme"), namespace_of("globex")
    plain, key = store.ensure(model, _ids())[0], store.ensure(model, _ids(), acme)[0]
    assert len({plain, key, store.key_for(model, _ids(), globex)}) == 3
    assert plain == chunk_key(model.fingerprint, dtype_name(model.dtype), _ids())  # "" keys as it always did
    assert store.describe(key)[0].namespace == acme and store.describe(plain)[0].namespace == ""
    assert b"namespace" not in store.tiers[0].path(plain).read_bytes()[:4096]  # unchanged bytes without one
    chunk = store.get(key, model)  # an entry claiming another namespace under this key: never served
    forged = serialize(key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values, globex)
    store.tiers[0].path(key).write_bytes(forged)
    assert store.get(key, model) is None and store.stats.evicted_corrupt == 1
    # opened as a request keyed it (namespace and ids known, compared without hashing): refused too
    store.tiers[0].path(key).write_bytes(forged)
    assert store.open(key, model, (acme, _ids())) is None
    assert store.stats.evicted_corrupt == 2
    store.ensure(model, _ids(), acme)
    reader = store.open(key, model, (acme, _ids()))
    assert reader is not None
    reader.close()
    assert namespace_of() == "" and namespace_of("", "salt") not in ("", acme)
    with pytest.raises(InputError, match="cache_salt"):
        namespace_of("acme", "x" * 257)


def test_entry_for_another_shape_is_never_served(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk = prefill_chunk(model, _ids())
    key = store.put(chunk)
    other = Decoder(model.model_dir)  # same weights, but pretend its config differs
    object.__setattr__(other.config, "num_kv_heads", 4)
    assert store.get(key, other) is None and not store.contains(key)


def test_bad_keys_and_configs_are_named(model, tmp_path):
    store = ChunkStore(StoreConfig(root=tmp_path))
    with pytest.raises(InputError, match="not a chunk key"):
        store.get("../secret")
    with pytest.raises(Exception, match="tiers"):
        StoreConfig(tiers=("tape",))
    with pytest.raises(Exception, match="redis_url"):
        StoreConfig(tiers=("redis",))


def test_keys_and_describe_across_tiers_count_nothing(model, tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path))
    a = store.put(prefill_chunk(model, _ids(seed=2)))
    store.tiers[0].delete(a)  # now on disk only
    b = store.put(prefill_chunk(model, _ids(seed=3)))
    assert store.keys() == sorted([a, b]) and store.tiers[0].keys() == [b]
    header, tiers = store.describe(a)
    assert tiers == ("disk",) and list(header.token_ids) == _ids(seed=2)
    assert store.describe(b)[1] == ("memory", "disk")
    assert store.describe("f" * 64) is None
    assert not store.stats.hits and store.stats.misses == 0 and not store.tiers[0].contains(a)


def test_temp_files_of_dead_writers_are_swept_on_open(tmp_path):
    from cachesmith.kvstore.disk_tier import DiskTier

    (tmp_path / "ab").mkdir()
    dead = tmp_path / "ab" / f".{'ab' + '0' * 62}.cskv.999999999.deadbeef.tmp"  # no such pid
    live = tmp_path / "ab" / f".{'ab' + '1' * 62}.cskv.{os.getpid()}.cafef00d.tmp"  # this process
    kept = tmp_path / "ab" / f"{'ab' + '2' * 62}.cskv"
    for f in (dead, live, kept):
        f.write_bytes(b"x")
    tier = DiskTier(tmp_path)
    assert tier.num_swept == 1 and not dead.exists() and live.exists() and kept.exists()


def test_a_disk_tier_whose_root_is_gone_is_down(tmp_path):
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path / "kv"))
    assert [t.is_up for t in store.tiers] == [True, True]
    (tmp_path / "kv").rmdir()  # unmounted, or removed under the server
    assert [t.is_up for t in store.tiers] == [True, False]


class _Flaky(MemoryTier):
    """A shared tier that can be away: while `is_down`, it neither stores nor deletes."""
    name = "redis"

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.is_down = False

    @property
    def is_up(self) -> bool:
        return not self.is_down

    def put(self, key, data):
        return False if self.is_down else super().put(key, data)

    def delete(self, key):
        return False if self.is_down else super().delete(key)


def test_an_entry_stored_while_a_tier_was_away_reaches_it_when_next_read(model):
    flaky = _Flaky()
    store = ChunkStore(tiers=[MemoryTier(1 << 30), flaky])
    flaky.is_down = True
    key, computed = store.ensure(model, _ids())
    assert computed and not flaky.contains(key)
    assert store.ensure(model, _ids()) == (key, False) and not flaky.contains(key)  # still away
    flaky.is_down = False
    assert store.ensure(model, _ids()) == (key, False)
    assert flaky.contains(key) and flaky.source(key).size == store.tiers[0].source(key).size
    other = ChunkStore(tiers=[MemoryTier(1 << 30), flaky])  # another server on the same shared tier
    assert torch.equal(other.get(key, model).keys, store.get(key, model).keys)


def test_a_delete_a_tier_cannot_do_stops_before_the_faster_copies(model):
    flaky = _Flaky()
    store = ChunkStore(tiers=[MemoryTier(1 << 30), flaky])
    key = store.put(prefill_chunk(model, _ids()))
    flaky.is_down = True
    assert store.delete(key) == ["redis"]
    assert store.tiers[0].contains(key) and store.get(key, model) is not None  # the store as it was
    flaky.is_down = False
    assert store.delete(key) == [] and not store.contains(key)


def test_a_delete_stopped_by_a_faster_tier_puts_the_slower_copies_back(model):
    shared, readonly = _Flaky(), _Flaky()  # a redis tier, and a disk tier gone read-only
    store = ChunkStore(tiers=[MemoryTier(1 << 30), readonly, shared])
    key = store.put(prefill_chunk(model, _ids()))
    readonly.delete = lambda k: False  # it still holds the entry and cannot delete it now
    assert store.delete(key) == [readonly.name]
    # the slowest copy, deleted first, is back: the entry is as durable as when it was stored
    assert shared.contains(key) and shared.source(key).size == readonly.source(key).size
    assert torch.equal(ChunkStore(tiers=[shared]).get(key, model).keys, store.get(key, model).keys)
