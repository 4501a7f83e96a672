"""The redis tier against a real redis-server: sharing across stores, partial reads, outage."""
from __future__ import annotations

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
    k, v = torch.zeros_like(chunk.keys[0]), torch.zeros_like(chunk.values[0])
    reader.read_layer_into(2, k, v, rows)
    assert torch.equal(k[rows], chunk.keys[2][rows]) and torch.equal(v[rows], chunk.values[2][rows])


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
    store.delete(shared)
    assert not store.contains(shared)


def test_a_redis_that_refuses_writes_is_skipped_but_up(model, redis_server, caplog):
    import redis

    redis.Redis.from_url(redis_server.url).config_set("maxmemory", 1)  # every write: OOM
    store = ChunkStore(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url))
    key = store.put(prefill_chunk(model, _ids(8)))
    assert "refused" in caplog.text and store.describe(key)[1] == ("memory",)
    assert store.tiers[1].is_up  # reachable: only the write was refused
