"""The redis tier on a real Redis Cluster (3 primaries, 3 replicas, `tests/redis_cluster.py`): the
URL of any node finds the cluster, entries spread over every primary, listing and usage cover all of
them, a delete announced through one tier reaches another, and a killed primary costs only its own
slots until its replica is promoted: no call raises, the other slots answer throughout, and its
slots are read again within the node timeout and 5 s."""
from __future__ import annotations

import logging
import time
import uuid

import redis

from cachesmith.kvstore.redis_tier import RedisTier, online_replicas
from benchmarks.common.redis_cluster import NODE_TIMEOUT_MS, start_cluster

ENTRY = b"x" * 512


def key(i: int) -> str:
    return f"{i:064x}"


def fresh_keys(n: int) -> list[str]:
    """Keys no other test of the session's shared cluster writes."""
    run = uuid.uuid4().hex[:16]
    return [run + f"{i:048x}" for i in range(n)]


def held_by(cluster, port: int, name: str, is_replica: bool = False) -> bool:
    """Whether the node on `port` holds `name` itself (a replica asked on a READONLY connection)."""
    node = redis.Redis(host="127.0.0.1", port=port, single_connection_client=True)
    try:
        if is_replica:
            node.execute_command("READONLY")
        return bool(node.exists(name))
    except redis.exceptions.MovedError:  # not this node's slot
        return False
    finally:
        node.close()


def test_any_node_finds_the_cluster_and_entries_spread_over_every_primary(redis_cluster):
    tier, keys = RedisTier(redis_cluster.url), fresh_keys(60)
    assert tier.is_cluster
    for k in keys:
        assert tier.put(k, ENTRY)
    primaries = redis_cluster.primaries()
    assert len(primaries) == 3
    held = [sum(held_by(redis_cluster, p, RedisTier.PREFIX + k) for k in keys) for p in primaries]
    assert all(n > 0 for n in held) and sum(held) == 60, held  # each entry on one primary, every primary used
    assert set(keys) <= set(tier.keys())  # every primary scanned
    usage = tier.usage()
    assert usage.num_entries >= 60 and usage.num_bytes >= 60 * len(ENTRY)
    described = tier.describe()
    assert "3 primaries and 3 replicas" in described and described.count("maxmemory") == 6


def test_maxmemory_is_set_on_every_node_and_bounds_the_sum_of_the_primaries(redis_cluster):
    tier = RedisTier(redis_cluster.url, max_bytes=1 << 30)
    assert all(redis_cluster.client(p).config_get("maxmemory")["maxmemory"] == str(1 << 30)
               for p in redis_cluster.live())
    assert tier.usage().max_bytes == 3 * (1 << 30)


def test_a_delete_announced_through_one_tier_reaches_another(redis_cluster):
    writer, reader = RedisTier(redis_cluster.url), RedisTier(redis_cluster.url)
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


def test_a_killed_primary_costs_only_its_slots_until_its_replica_takes_them(tmp_path, caplog):
    """Written as uploads are (a replica's copy confirmed), then the primary killed at once: every
    entry is read again, from the promoted replica."""
    cluster = start_cluster(tmp_path / "cluster")  # its own: a node of it dies
    try:
        killed_primary_is_replaced(cluster, caplog)
    finally:
        cluster.stop()


def killed_primary_is_replaced(cluster, caplog) -> None:
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
            tier.is_up  # a ping may meet the dead node: it must not back off the live ones
            found = {key(i) for i in range(60) if tier.source(key(i)) is not None}  # never raises
            assert found >= {key(i) for i in range(60)} - on_victim  # the other slots answer throughout
            if found == {key(i) for i in range(60)}:
                break
            time.sleep(0.2)
    back_s = time.monotonic() - killed_at
    assert found == {key(i) for i in range(60)}, f"{len(on_victim - found)} keys still missing after {back_s:.1f} s"
    assert any("node" in r.getMessage() for r in caplog.records)  # backed off the node, not the tier


def test_a_replicated_write_is_on_a_replica_when_it_returns(redis_cluster):
    tier, [k] = RedisTier(redis_cluster.url), fresh_keys(1)
    assert tier.put_replicated(k, ENTRY) is True
    name = RedisTier.PREFIX + k
    primary = tier.client.get_node_from_key(name).port
    replicas = [p for p in redis_cluster.live() if redis_cluster.role(p) == "slave"
                and redis_cluster.client(p).info("replication")["master_port"] == primary]
    assert len(replicas) == 1 and held_by(redis_cluster, replicas[0], name, is_replica=True)


def test_only_a_replica_in_sync_is_waited_for():
    """A node restarted after its failover rejoins as a replica and loads its first copy for a
    while: a write waiting on it would time out, so it does not count until it is online."""
    syncing = {"role": "master", "connected_slaves": 1,
               "slave0": {"ip": "127.0.0.1", "port": 7001, "state": "wait_bgsave", "offset": 0, "lag": 0}}
    assert online_replicas(syncing) == 0
    online = {**syncing, "slave0": {**syncing["slave0"], "state": "online"},
              "slave1": {"ip": "127.0.0.1", "port": 7002, "state": "send_bulk", "offset": 0, "lag": 0}}
    assert online_replicas(online) == 1
