"""The redis tier against a real redis-server: sharing across stores, partial reads, outage."""
from __future__ import annotations

import time

import torch

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.reader import EntryReader
from cachesmith.model import prefill_chunk


def _ids(seed=0):
    return torch.randint(3, 120, (130,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_two_processes_share_one_cache(model, redis_url, tmp_path):
    writer = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_url))
    chunk = prefill_chunk(model, _ids())
    key = writer.put(chunk)
    reader_store = ChunkStore(StoreConfig(tiers=("memory", "disk", "redis"), root=tmp_path, redis_url=redis_url))
    got = reader_store.get(key, model)
    assert torch.equal(got.keys, chunk.keys) and reader_store.stats.hits["redis"] == 1
    assert reader_store.tiers[1].contains(key)  # filled on the way back


def test_redis_partial_layer_reads(model, redis_url):
    store = ChunkStore(StoreConfig(tiers=("redis",), redis_url=redis_url))
    chunk = prefill_chunk(model, _ids(1))
    key = store.put(chunk)
    reader = EntryReader(store.tiers[0].source(key))
    rows = torch.tensor([2, 70, 129])
    k = torch.zeros(chunk.keys[0].shape, dtype=chunk.dtype)  # entries are read into host memory
    v = torch.zeros(chunk.values[0].shape, dtype=chunk.dtype)
    reader.read_layer_into(2, k, v, rows)
    assert torch.equal(k[rows], chunk.keys[2].cpu()[rows]) and torch.equal(v[rows], chunk.values[2].cpu()[rows])


def test_unreachable_redis_falls_back_to_local_tiers(model, tmp_path, caplog):
    store = ChunkStore(StoreConfig(tiers=("memory", "disk", "redis"), root=tmp_path,
                                   redis_url="redis://127.0.0.1:1/0"))
    chunk = prefill_chunk(model, _ids(2))
    key = store.put(chunk)  # memory and disk take it; redis warns
    assert "unreachable" in caplog.text
    assert torch.equal(store.get(key, model).keys, chunk.keys)
    assert not store.tiers[2].is_available  # backing off: no reconnect storm


def test_redis_lists_its_keys(model, redis_url):
    store = ChunkStore(StoreConfig(tiers=("redis",), redis_url=redis_url))
    key = store.put(prefill_chunk(model, _ids(seed=5)))
    assert key in store.tiers[0].keys() and key in store.keys()
    store.delete(key)
    assert key not in store.keys()


def test_a_redis_that_goes_away_leaves_the_local_tiers_serving(model, redis_server, caplog):
    store = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url))
    redis_tier = store.tiers[1]
    shared = store.put(prefill_chunk(model, _ids(6)))
    assert redis_tier.is_up and redis_tier.contains(shared)
    redis_server.stop()
    chunk = prefill_chunk(model, _ids(7))
    local = store.put(chunk)  # memory takes it; redis warns and is skipped
    assert "unreachable" in caplog.text and not redis_tier.is_up
    assert torch.equal(store.get(local, model).keys, chunk.keys)
    assert store.contains(shared) and store.keys() == sorted([shared, local])
    assert store.describe(local)[1] == ("memory",)
    # a delete now would leave the entry in redis, to come back when redis does: refused, nothing removed
    assert store.delete(shared) == ["redis"] and store.tiers[0].contains(shared)
    assert store.delete(local) == ["redis"]  # redis cannot say it does not hold it either


def test_a_redis_that_refuses_writes_is_skipped_but_up(model, redis_server, caplog):
    import redis

    redis.Redis.from_url(redis_server.url).config_set("maxmemory", 1)  # every write: OOM
    store = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url))
    key = store.put(prefill_chunk(model, _ids(8)))
    assert "refused" in caplog.text and store.describe(key)[1] == ("memory",)
    assert store.tiers[1].is_up  # reachable: only the write was refused


def test_an_entry_redis_refused_reaches_it_by_the_retry_pass_once_it_has_room(model, redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory", 1)  # every write refused (OOM), redis still up
    store = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url, retry_interval_s=0.05))
    key = store.put(prefill_chunk(model, _ids(9)))
    assert store.describe(key)[1] == ("memory",)
    client.config_set("maxmemory", 0)  # room again: no read of the entry is needed to fill redis
    assert _until(lambda: store.tiers[1].contains(key)), "the retry pass never wrote the entry to redis"
    other = ChunkStore(StoreConfig(tiers=("redis",), redis_url=redis_server.url))  # another server
    assert torch.equal(other.get(key, model).keys, store.get(key, model).keys)
    store.close(), other.close()


def _until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_delete_through_one_store_drops_every_stores_local_copy(model, redis_url, tmp_path):
    one = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_url))
    other = ChunkStore(StoreConfig(tiers=("memory", "disk", "redis"), root=tmp_path, redis_url=redis_url))
    try:
        key = one.put(prefill_chunk(model, _ids(5)))
        assert other.get(key, model) is not None and other.tiers[0].contains(key) and other.tiers[1].contains(key)
        one.delete(key)
        assert _until(lambda: not other.contains(key))  # memory and disk copies announced away
        assert other.get(key, model) is None
    finally:
        for store in (one, other):
            store.close()


def test_evicting_a_corrupt_redis_entry_leaves_other_stores_copies(model, redis_url):
    one = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_url))
    other = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_url))
    try:
        key = one.put(prefill_chunk(model, _ids(6)))
        assert other.get(key, model) is not None  # other's memory holds a sound copy
        redis_tier = one.tiers[1]
        redis_tier.client.setrange(redis_tier.PREFIX + key, 0, b"garbage!")
        one.tiers[0].delete(key)
        assert one.get(key, model) is None and not redis_tier.contains(key)  # evicted from redis
        marker = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_url))
        marker_key = marker.put(prefill_chunk(model, _ids(7)))
        assert other.get(marker_key, model) is not None and other.tiers[0].contains(marker_key)
        marker.delete(marker_key)  # announced after the eviction: once other drops it, it saw both
        assert _until(lambda: not other.tiers[0].contains(marker_key))
        assert other.tiers[0].contains(key)
        marker.close()
    finally:
        for store in (one, other):
            store.close()


def test_a_replicated_write_to_a_server_without_replicas_waits_for_nothing(model, redis_server):
    """One redis server has no replica to wait for: an upload's write is stored and not refused."""
    store = ChunkStore(StoreConfig(tiers=("redis",), redis_url=redis_server.url))
    tier, writes = store.tiers[0], []
    real_put, real_replicated = tier.put, tier.put_replicated
    tier.put = lambda *a: writes.append("put") or real_put(*a)
    tier.put_replicated = lambda *a: writes.append("replicated") or real_replicated(*a)
    key, is_new = store.ensure(model, list(range(4, 12)), is_replicated=True)
    assert is_new and store.contains(key)
    assert writes == ["replicated"]  # a new upload is written once, waited for in the same write
    assert tier.put_replicated(key, b"x") is True  # written; nothing to wait for: not a refusal
    redis_server.stop()  # away: not written (retried later), the upload not refused
    assert tier.put_replicated(key, b"x") is None
