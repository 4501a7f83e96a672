"""A tenant's byte cap across servers: with a redis tier every server sharing it counts one total
(atomic: racing reserves never both pass), deletes and expired entries free room everywhere, and a
redis outage falls back to the per-process count; without redis the start log says the cap is per
process."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.keys import namespace_of
from cachesmith.kvstore.redis_tier import RedisTier
from cachesmith.model.config import ModelConfig, load_hf_config
from cachesmith.pipeline import RagPipeline
from cachesmith.server import Service, ServiceConfig
from cachesmith.server import redis_usage
from cachesmith.server.redis_usage import RedisUsage, tenant_usage
from cachesmith.server.tenancy import Caller, StoreQuotaExceeded, StoreUsage
from tests.redis_server import start_redis
from tests.server.conftest import NAME, make_service, tiny_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

ACME = Caller("acme")
NS = namespace_of("acme")
WORDS = "river glacier lantern harbor copper amber silent frozen meadow canyon willow ember".split()


def text(i: int, num_words: int = 10) -> str:
    return f"passage {i} " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(num_words))


def per_token(model_dir) -> int:
    cfg = ModelConfig.from_hf(load_hf_config(model_dir))
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 KV


def redis_service(model_dir, url: str, cap: int | None, tiers=("memory", "redis"), ttl_s: int = 3600,
                  **store) -> Service:
    config = ServiceConfig(model=str(model_dir), served_name=NAME, tenant_max_bytes=cap)
    pipe = RagPipeline(str(model_dir), store=ChunkStore(StoreConfig(tiers=tiers, redis_url=url, redis_ttl_s=ttl_s,
                                                                    **store)))
    return Service(config, pipe, tiny_profile(pipe))


def stored_in_redis(service: Service, namespace: str) -> list[int]:
    """Bytes of each entry of `namespace` that redis holds now (what every server sees)."""
    tier = next(t for t in service.store.tiers if isinstance(t, RedisTier))
    sizes = []
    for key in tier.keys():
        described = service.store.describe(key)
        if described is not None and described[0].namespace == namespace and "redis" in described[1]:
            sizes.append(described[0].total_bytes)
    return sizes


@pytest.fixture(params=["one server", "cluster"])
def shared_redis_url(request, tmp_path):
    """The URL of a redis server of this test's own, or of one node of the session's Redis Cluster
    (3 primaries, 3 replicas; the tests' namespaces are their own)."""
    if request.param == "one server":
        server = start_redis(tmp_path)
        yield server.url
        server.stop()
    else:
        yield request.getfixturevalue("redis_cluster_url")


def servers_on(model_dir, url: str):
    made = []

    def make(cap: int | None, **kw) -> Service:
        made.append(redis_service(model_dir, url, cap, **kw))
        return made[-1]

    return make, made


@pytest.fixture()
def two_servers(tiny_chat_dir, redis_server):
    make, made = servers_on(tiny_chat_dir, redis_server.url)
    yield make
    for service in made:
        service.close(10)


@pytest.fixture()
def two_servers_anywhere(tiny_chat_dir, shared_redis_url):
    make, made = servers_on(tiny_chat_dir, shared_redis_url)
    yield make
    for service in made:
        service.close(10)


def test_two_servers_on_one_redis_hold_one_tenant_cap(two_servers_anywhere, tiny_chat_dir):
    two_servers = two_servers_anywhere
    cap = per_token(tiny_chat_dir) * 100  # room for about eight uploads, not sixteen
    a, b = two_servers(cap), two_servers(cap)
    assert a.chunks.usage.is_shared and isinstance(a.chunks.usage, RedisUsage)
    accepted, refused = [], []
    for i in range(16):
        try:
            accepted += [(i % 2, r) for r in (a, b)[i % 2].add_chunks([text(i)], caller=ACME)]
        except StoreQuotaExceeded as exc:
            assert "--tenant-max-bytes" in str(exc)
            refused.append(i)
    assert refused and {server for server, _ in accepted} == {0, 1}  # both took uploads, then refused
    counted = sum(r.num_tokens for _, r in accepted) * per_token(tiny_chat_dir)
    assert counted <= cap  # one count for both: per process each would have taken the whole cap
    assert a.chunks.usage.used(NS) == b.chunks.usage.used(NS) == counted
    sizes = stored_in_redis(a, NS)
    assert len(sizes) == len(accepted) and sum(sizes) <= cap + max(sizes)  # at most one entry's header over


def test_a_delete_through_one_server_frees_room_seen_by_the_other(two_servers, tiny_chat_dir):
    a, b = two_servers(per_token(tiny_chat_dir) * 20), two_servers(per_token(tiny_chat_dir) * 20)
    [first] = a.add_chunks([text(0)], caller=ACME)
    assert 10 < first.num_tokens <= 20  # the next one does not fit beside it
    with pytest.raises(StoreQuotaExceeded):
        b.add_chunks([text(1)], caller=ACME)
    with pytest.raises(StoreQuotaExceeded):  # another tenant's count is its own, this one still full
        a.add_chunks([text(1)], caller=ACME)
    assert b.add_chunks([text(1)], caller=Caller("globex"))[0].is_new
    assert a.delete_chunk(first.chunk_id, ACME)
    assert b.chunks.usage.used(NS) == 0
    assert b.add_chunks([text(1)], caller=ACME)[0].is_new


def test_an_entry_that_expired_in_redis_stops_counting(two_servers, tiny_chat_dir):
    cap = per_token(tiny_chat_dir) * 20
    a, b = two_servers(cap, tiers=("redis",), ttl_s=1), two_servers(cap, tiers=("redis",), ttl_s=1)
    [first] = a.add_chunks([text(0)], caller=ACME)
    with pytest.raises(StoreQuotaExceeded):
        b.add_chunks([text(1)], caller=ACME)
    time.sleep(1.5)  # the entry's TTL runs out: redis no longer holds it
    assert not a.store.contains(first.chunk_id)
    assert b.add_chunks([text(1)], caller=ACME)[0].is_new
    assert a.chunks.usage.used(NS) < first.num_tokens * per_token(tiny_chat_dir) * 2


def test_an_entry_evicted_from_redis_stops_counting_though_a_server_keeps_a_copy(two_servers, tiny_chat_dir):
    cap = per_token(tiny_chat_dir) * 20
    a, b = two_servers(cap), two_servers(cap)
    [first] = a.add_chunks([text(0)], caller=ACME)
    with pytest.raises(StoreQuotaExceeded):
        b.add_chunks([text(1)], caller=ACME)
    a.store.tiers[1].client.delete(RedisTier.PREFIX + first.chunk_id)  # maxmemory's LRU took it
    assert a.store.contains(first.chunk_id)  # a's memory tier still holds a copy: a cache, not the store
    assert b.add_chunks([text(1)], caller=ACME)[0].is_new


def test_entries_stored_before_any_server_counted_are_counted(two_servers, tiny_chat_dir):
    uncapped = two_servers(None)
    [old] = uncapped.add_chunks([text(0)], caller=ACME)
    capped = two_servers(per_token(tiny_chat_dir) * 20)
    with pytest.raises(StoreQuotaExceeded):
        capped.add_chunks([text(1)], caller=ACME)
    assert capped.chunks.usage.used(NS) >= old.num_tokens * per_token(tiny_chat_dir)


def reserving_usage(url: str) -> RedisUsage:
    """A redis count with no model behind it: a server's, reserving keys it has not written yet."""
    usage = tenant_usage(ChunkStore(StoreConfig(tiers=("redis",), redis_url=url)))
    assert isinstance(usage, RedisUsage)
    return usage


def test_racing_reserves_on_the_redis_count_never_both_pass(shared_redis_url):
    servers = [reserving_usage(shared_redis_url) for _ in range(2)]
    num_threads, num_rounds = 8, 25
    passed = [[] for _ in range(num_rounds)]
    barrier = threading.Barrier(num_threads)

    def race(t: int) -> None:
        for r in range(num_rounds):
            barrier.wait()
            try:  # each wants 60 of the namespace's 100 bytes: one fits
                servers[t % 2].reserve(f"{r:032x}", {uuid.uuid4().hex * 2: 60}, 100, "documents")
                passed[r].append(t)
            except StoreQuotaExceeded:
                pass

    threads = [threading.Thread(target=race, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [len(p) for p in passed] == [1] * num_rounds
    assert all(servers[0].used(f"{r:032x}") == 60 for r in range(num_rounds))


def test_a_reservation_never_written_is_freed_after_the_grace(redis_server, monkeypatch):
    usage = reserving_usage(redis_server.url)
    usage.reserve(NS, {"a" * 64: 60}, 100, "documents")  # its prefill failed: never written
    with pytest.raises(StoreQuotaExceeded, match="to 120 bytes, past its quota of 100"):
        usage.reserve(NS, {"b" * 64: 60}, 100, "documents")  # still being prefilled, for all we know
    monkeypatch.setattr(redis_usage, "PENDING_GRACE_S", 0.05)
    time.sleep(0.1)
    usage.reserve(NS, {"b" * 64: 60}, 100, "documents")
    assert usage.used(NS) == 60


def test_a_redis_outage_counts_per_process_then_catches_up(tiny_chat_dir, redis_server, tmp_path, caplog):
    cap = per_token(tiny_chat_dir) * 40
    # no write-back of the missed entries during the test: redis's count then holds what was
    # reserved during the outage and nothing else
    service = redis_service(tiny_chat_dir, redis_server.url, cap, retry_interval_s=3600)
    service.store.tiers[1].retry_after_s = 0.2  # come back fast
    try:
        service.add_chunks([text(0)], caller=ACME)  # counted in the redis that goes away (its count with it)
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="cachesmith.server.redis_usage"):
            [second] = service.add_chunks([text(1)], caller=ACME)  # served, counted here
            with pytest.raises(StoreQuotaExceeded):  # the local tiers still hold both: past the cap
                service.add_chunks([text(2, num_words=20)], caller=ACME)
        assert sum("per process meanwhile" in r.message for r in caplog.records) == 1  # once per outage
        assert isinstance(service.chunks.usage.local, StoreUsage)
        back = start_redis(tmp_path, port=int(redis_server.url.rsplit(":", 1)[1].split("/")[0]))
        try:
            time.sleep(0.3)
            with caplog.at_level(logging.INFO, logger="cachesmith.server.redis_usage"):
                assert service.chunks.usage.used(NS) == second.num_tokens * per_token(tiny_chat_dir)
            assert any("answers again" in r.message for r in caplog.records)
            assert service.chunks.usage.local is None
        finally:
            back.stop()
    finally:
        service.close(10)


def test_the_start_log_says_whether_the_cap_holds_across_servers(tiny_chat_dir, redis_server, caplog):
    with caplog.at_level(logging.INFO, logger="cachesmith.server.chunks"):
        local = make_service(tiny_chat_dir, tenant_max_bytes=1 << 20)
        shared = redis_service(tiny_chat_dir, redis_server.url, 1 << 20)
    local.close(10)
    shared.close(10)
    messages = [(r.levelno, r.message) for r in caplog.records if "--tenant-max-bytes" in r.message]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]
    assert "per server process" in messages[0][1] and "every server sharing it" in messages[1][1]
    assert not isinstance(local.chunks.usage, RedisUsage) and shared.chunks.usage.is_shared
