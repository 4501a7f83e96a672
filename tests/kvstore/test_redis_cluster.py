"""The redis tier on a real Redis Cluster (3 primaries, 3 replicas, `tests/redis_cluster.py`): the
URL of any node finds the cluster, entries spread over every primary, listing and usage cover all of
them, a delete announced through one tier reaches another, and a killed primary costs only its own
slots until its replica is promoted: no call raises, the other slots answer throughout, and its
slots are read again within the node timeout and 5 s."""
from __future__ import annotations

import logging
import time

import pytest

from cachesmith.kvstore.redis_tier import RedisTier
from benchmarks.common.redis_cluster import NODE_TIMEOUT_MS, start_cluster

ENTRY = b"x" * 512


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture()
def cluster(tmp_path):
    started = start_cluster(tmp_path / "cluster")
    yield started
    started.stop()


def test_any_node_finds_the_cluster_and_entries_spread_over_every_primary(cluster):
    tier = RedisTier(cluster.url)
    assert tier.is_cluster
    for i in range(60):
        assert tier.put(key(i), ENTRY)
    primaries = cluster.primaries()
    assert len(primaries) == 3
    held = [cluster.client(p).dbsize() for p in primaries]
    assert all(n > 0 for n in held) and sum(held) == 60, held
    assert tier.keys() == [key(i) for i in range(60)]  # every primary scanned
    usage = tier.usage()
    assert (usage.num_entries, usage.num_bytes) == (60, 60 * len(ENTRY))
    described = tier.describe()
    assert "3 primaries and 3 replicas" in described and described.count("maxmemory") == 6


def test_maxmemory_is_set_on_every_node_and_bounds_the_sum_of_the_primaries(cluster):
    tier = RedisTier(cluster.url, max_bytes=64 << 20)
    assert all(cluster.client(p).config_get("maxmemory")["maxmemory"] == str(64 << 20) for p in cluster.live())
    assert tier.usage().max_bytes == 3 * (64 << 20)


def test_a_delete_announced_through_one_tier_reaches_another(cluster):
    writer, reader = RedisTier(cluster.url), RedisTier(cluster.url)
    heard: list[str] = []
    reader.watch_deletes(heard.append)
    try:
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:  # the subscription may land after the first message
            writer.announce_delete(key(7))
            time.sleep(0.1)
        assert heard and heard[0] == key(7)
    finally:
        reader.close()


def test_a_killed_primary_costs_only_its_slots_until_its_replica_takes_them(cluster, caplog):
    """Written as uploads are (a replica's copy confirmed), then the primary killed at once: every
    entry is read again, from the promoted replica."""
    tier = RedisTier(cluster.url)
    for i in range(60):
        assert tier.put_replicated(key(i), ENTRY) is True
    victim = cluster.primaries()[0]
    on_victim = {key(i) for i in range(60) if tier.client.get_node_from_key(RedisTier.PREFIX + key(i)).port == victim}
    assert 0 < len(on_victim) < 60
    cluster.kill(victim)
    killed_at = time.monotonic()
    limit_s = NODE_TIMEOUT_MS / 1e3 + 5
    with caplog.at_level(logging.WARNING):
        while time.monotonic() - killed_at < limit_s:
            found = {key(i) for i in range(60) if tier.source(key(i)) is not None}  # never raises
            assert found >= {key(i) for i in range(60)} - on_victim  # the other slots answer throughout
            if found == {key(i) for i in range(60)}:
                break
            time.sleep(0.2)
    back_s = time.monotonic() - killed_at
    assert found == {key(i) for i in range(60)}, f"{len(on_victim - found)} keys still missing after {back_s:.1f} s"
    assert any("node" in r.getMessage() for r in caplog.records)  # backed off the node, not the tier


def test_a_replicated_write_is_on_a_replica_when_it_returns(cluster):
    tier = RedisTier(cluster.url)
    assert tier.put_replicated(key(1), ENTRY) is True
    primary = tier.client.get_node_from_key(RedisTier.PREFIX + key(1)).port
    replicas = [p for p in cluster.live() if cluster.role(p) == "slave"
                and cluster.client(p).info("replication")["master_port"] == primary]
    assert len(replicas) == 1 and cluster.client(replicas[0]).dbsize() == 1
