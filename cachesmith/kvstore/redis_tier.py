"""The redis tier: entries as redis strings, shared by every server that names the same redis, on one
redis server or on a Redis Cluster.

In: a URL of a redis server, or of any node of a cluster. Out: a `Tier`; GETRANGE reads a layer or a
row range. The node the URL names says whether it is in a cluster (`INFO cluster`), so the same
`--redis-url` serves both and cannot disagree with the server; a cluster is then reached through
`redis.cluster.RedisCluster`, which follows `MOVED` and `ASK` and learns a failover's new primaries.
Entries spread over the hash slots by their own keys (no hash tag: a namespace's entries are not kept
together); what must be together (a tenant's counts, `server.redis_usage`) carries one tag.

Failures never raise into serving: an unreachable server, or a cluster node, is backed off and its
calls answer as an empty tier, so the store serves from its local tiers or prefills. On one server
the whole tier backs off (`retry_after_s`); on a cluster only the node serving the key does, for
`NODE_RETRY_AFTER_S` (its replica takes its slots within the cluster's node timeout), and a
`CLUSTERDOWN` backs off the tier as a whole for that long.

Bounds: each entry expires `ttl_s` after its last write or open (None: never). Bytes are bounded by
each redis server's own `maxmemory` with `allkeys-lru`, not here: the tier cannot see what other
servers write. `max_bytes` sets it on every node at start (`redis_memory`).
"""
from __future__ import annotations

import logging
import threading
import time

from cachesmith.errors import InputError
from cachesmith.kvstore.disk_quota import TierUsage
from cachesmith.kvstore.keys import validate_key
from cachesmith.kvstore.redis_memory import memory_config, node_roles
from cachesmith.kvstore.sources import _SequentialReads
from cachesmith.kvstore.tiers import Tier

log = logging.getLogger(__name__)
DEFAULT_REDIS_TTL_S = 7 * 24 * 3600  # an entry nobody read for a week is recomputed when next needed
REDIS_RETRY_AFTER_S = 5.0  # a redis server that failed is tried again after this
NODE_RETRY_AFTER_S = 1.0  # a cluster node that failed: its slots are tried again after this
REPLICA_WAIT_MS = 1000  # how long an upload waits for a replica's copy before it is refused (503)
WHOLE = "*"  # the back-off of the tier as a whole (one server, or a cluster that is down)


class Backoff:
    """Until when each node ("*": all of them) is left alone after a failure (no reconnect storm)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def is_down(self, node: str) -> bool:
        now = time.monotonic()
        return now < self._until.get(WHOLE, 0.0) or now < self._until.get(node, 0.0)

    def fail(self, node: str, seconds: float) -> None:
        self._until[node] = time.monotonic() + seconds


def connect(url: str, timeout_s: float):
    """(client, is_cluster) for the redis at `url`: a `RedisCluster` when that node is in a cluster.
    Raises the redis errors of an unreachable server."""
    import redis
    from redis.cluster import RedisCluster

    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    probe = redis.Redis.from_url(url, **options)
    if int(probe.info("cluster").get("cluster_enabled", 0)) != 1:
        return probe, False
    probe.close()
    return RedisCluster.from_url(url, **options), True


def online_replicas(replication: dict) -> int:
    """Replicas of a primary that are in sync (`INFO replication`'s `slaveN` with `state=online`): a
    replica still loading its first copy (a restarted node rejoining) cannot confirm a write yet."""
    return sum(1 for name, value in replication.items()
               if name.startswith("slave") and name[5:].isdigit() and isinstance(value, dict)
               and value.get("state") == "online")


class RedisTier(Tier):
    name = "redis"
    PREFIX = "cachesmith:kv:"
    DELETED = "cachesmith:kv-deleted"  # (sharded, on a cluster) pub/sub channel: keys deleted through any server

    def __init__(self, url: str, retry_after_s: float = REDIS_RETRY_AFTER_S, timeout_s: float = 2.0,
                 ttl_s: int | None = DEFAULT_REDIS_TTL_S, max_bytes: int | None = None) -> None:
        import redis

        if ttl_s is not None and ttl_s <= 0:
            raise InputError(f"redis tier ttl_s={ttl_s} must be a positive number of seconds (None: no expiry)")
        self.url, self.ttl_s, self.retry_after_s, self.timeout_s = url, ttl_s, retry_after_s, timeout_s
        self.client, self.is_cluster = None, False
        self._backoff = Backoff()
        self._unreachable = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        # a cluster between owners for some slots (failing over, or a slot not served): back off
        self._cluster_down = (redis.exceptions.ClusterError, redis.exceptions.RedisClusterException,
                              redis.exceptions.TryAgainError)
        self._refused = redis.exceptions.RedisError
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._call(lambda: None, None)  # connect now if redis answers (else at the first call after the back-off)
        self.memory_config = {} if self.client is None else \
            memory_config(self.client, url, ttl_s, (self._refused, OSError), max_bytes, self.is_cluster)

    @property
    def is_available(self) -> bool:
        """False while the tier as a whole is backing off after a failure."""
        return not self._backoff.is_down(WHOLE)

    @property
    def is_up(self) -> bool:
        # a PING, so a server that went away while no request touched it still reads as down;
        # while backing off no PING is sent, so a scrape never hammers a dead server
        return self.is_available and bool(self._call(lambda: self.client.ping(), False))

    def connected(self) -> bool:
        """Whether the tier has a client, connecting now if it has none and is not backing off."""
        if self.client is None:
            self._call(lambda: None, None)
        return self.client is not None

    def describe(self) -> str:
        """The start line's: the server, or the cluster's primaries and replicas, with maxmemory."""
        if self.client is None:
            return f"{self.url} (unreachable at start: tried again after {self.retry_after_s:.0f} s)"
        if not self.is_cluster:
            return f"{self.url}, maxmemory {self.memory_config.get('maxmemory', 'unknown')}"
        roles = node_roles(self.client)
        nodes = [f"{name} ({role}, maxmemory {self.memory_config.get(name, {}).get('maxmemory', 'unknown')})"
                 for name, role in sorted(roles.items(), key=lambda r: (r[1], r[0]))]
        num_primaries = sum(r == "primary" for r in roles.values())
        return f"cluster of {num_primaries} primaries and {len(roles) - num_primaries} replicas: {', '.join(nodes)}"

    def _call(self, fn, default, name: str | None = None):
        node = self._node(name)
        if self._backoff.is_down(node):
            return default
        try:
            if self.client is None:
                self.client, self.is_cluster = connect(self.url, self.timeout_s)
            return fn()
        except self._unreachable as exc:
            self._fail(node, exc, "unreachable")
        except self._cluster_down as exc:  # CLUSTERDOWN, TRYAGAIN: the node's slots are being failed over
            self._fail(node, exc, "between primaries")
        except self._refused as exc:  # reachable but refused the command (out of memory, read-only)
            log.warning("redis tier %s refused a command (%s); skipped", self.url, exc)
        return default

    def _node(self, name: str | None) -> str:
        """The cluster node serving `name` as the client knows it now ("*": one server, or not known)."""
        if not self.is_cluster or name is None:
            return WHOLE
        try:
            return self.client.get_node_from_key(name).name
        except Exception:  # no slot owner known yet
            return WHOLE

    def _fail(self, node: str, exc: Exception, what: str) -> None:
        seconds = NODE_RETRY_AFTER_S if self.is_cluster else self.retry_after_s
        if self.is_cluster and node == WHOLE and isinstance(exc, self._unreachable):
            # a call of no one key (a ping, a scan) met one dead node: the client drops it from its
            # map; backing off every slot for it would cost the live primaries' keys too
            log.warning("redis tier %s: a node was unreachable (%s)", self.url, exc)
            return
        self._backoff.fail(node, seconds)
        where = f"node {node} of " if node != WHOLE else ""
        log.warning("redis tier %s%s %s (%s); using local tiers for its keys for %.0f s", where, self.url, what,
                    exc, seconds)

    def source(self, key: str):
        name = self.PREFIX + validate_key(key)
        size = self._call(lambda: self._size_and_refresh(name), 0, name)
        return _RedisSource(self, name, size) if size else None

    def _size_and_refresh(self, name: str) -> int:
        """STRLEN, and the TTL restarted in the same round trip (a read keeps a hot entry alive)."""
        if self.ttl_s is None:
            return self.client.strlen(name)
        size, _ = self.client.pipeline(transaction=False).strlen(name).expire(name, self.ttl_s).execute(
            raise_on_error=False)  # an EXPIRE refused (a read-only replica) must not fail the read
        if isinstance(size, Exception):
            raise size
        return size

    def put(self, key: str, data: bytes) -> bool:
        name = self.PREFIX + validate_key(key)
        return bool(self._call(lambda: self.client.set(name, data, ex=self.ttl_s), False, name))

    def put_replicated(self, key: str, data: bytes) -> bool | None:
        """`put`, then `WAIT` until one replica of the key's primary has it (up to
        `REPLICA_WAIT_MS`): replication is asynchronous, so a primary lost before its replica copied
        an entry loses it. True: written, and confirmed where the primary has a replica in sync
        (without one there is nothing to wait for); False: written, no replica confirmed in time;
        None: not written (unreachable or refused: the store's missed-write retry brings it later)."""
        name = self.PREFIX + validate_key(key)

        def write() -> bool | None:
            conn = self.client.get_redis_connection(self.client.get_node_from_key(name)) if self.is_cluster \
                else self.client
            if online_replicas(conn.info("replication")) < 1:
                return True if conn.set(name, data, ex=self.ttl_s) else None
            pipe = conn.pipeline(transaction=False)  # one connection: WAIT counts its own writes
            pipe.set(name, data, ex=self.ttl_s)
            pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
            is_set, num_acked = pipe.execute()
            return None if not is_set else int(num_acked) >= 1

        return self._call(write, None, name)

    def delete(self, key: str) -> bool:
        name = self.PREFIX + validate_key(key)
        return self._call(lambda: self.client.delete(name), None, name) is not None

    def contains(self, key: str) -> bool:
        name = self.PREFIX + validate_key(key)
        return bool(self._call(lambda: self.client.exists(name), 0, name))

    def announce_delete(self, key: str) -> None:
        """Tell every store on this redis that a client deleted `key`, so they drop their local
        copies (a corrupt entry's eviction is not announced: other copies may be sound). On a
        cluster the channel is sharded: its messages go through the one shard that owns it."""
        key = validate_key(key)
        publish = (lambda: self.client.spublish(self.DELETED, key)) if self.is_cluster else \
            (lambda: self.client.publish(self.DELETED, key))
        self._call(publish, 0, self.DELETED)

    def watch_deletes(self, forget) -> None:
        """Call `forget(key)` for every key announced deleted, on a daemon thread, until `close()`.
        Deletes announced while this store was cut off from redis are missed (pub/sub keeps nothing)."""
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, args=(forget,), daemon=True,
                                              name="cachesmith-redis-deletes")
            self._listener.start()

    def _listen(self, forget) -> None:
        while not self._closed.is_set():
            if self.client is None and self._call(lambda: None, False) is False:
                self._closed.wait(self.retry_after_s)
                continue
            pubsub = None
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._read_announcements(pubsub, forget)
            except (*self._unreachable, *self._cluster_down):
                self._closed.wait(NODE_RETRY_AFTER_S if self.is_cluster else self.retry_after_s)
            except Exception:  # a bad message must not end the watch
                log.exception("redis tier %s: a delete announcement failed", self.url)
            finally:
                if pubsub is not None:
                    pubsub.close()

    def _read_announcements(self, pubsub, forget) -> None:
        if self.is_cluster:
            pubsub.ssubscribe(self.DELETED)
        else:
            pubsub.subscribe(self.DELETED)
        while not self._closed.is_set():
            message = pubsub.get_sharded_message(timeout=0.5) if self.is_cluster else pubsub.get_message(timeout=0.5)
            if message and message["type"] in ("message", "smessage"):
                data = message["data"]
                forget(data.decode() if isinstance(data, bytes) else data)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.join(timeout=5)

    def keys(self) -> list[str]:
        """Every entry's key, on one server or on every primary of a cluster."""
        names = self._call(lambda: list(self.client.scan_iter(match=self.PREFIX + "*", count=1000)), [])
        return sorted(n.decode()[len(self.PREFIX):] if isinstance(n, bytes) else n[len(self.PREFIX):]
                      for n in names)

    def usage(self) -> TierUsage:
        names = [self.PREFIX + key for key in self.keys()]

        def sizes() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return pipe.execute()

        sized = self._call(sizes, []) if names else []
        return TierUsage(self.name, len(sized), sum(sized), self._max_bytes(), note=f"{self._bound()}; ttl_s={self.ttl_s}")

    def _max_bytes(self) -> int | None:
        """maxmemory summed over the primaries (each node bounds its own share), or None."""
        if not self.is_cluster:
            return int(self.memory_config.get("maxmemory", 0)) or None
        roles = node_roles(self.client) if self.client is not None else {}
        limits = [int(self.memory_config.get(n, {}).get("maxmemory", 0)) for n, r in roles.items() if r == "primary"]
        return sum(limits) if limits and all(limits) else None

    def _bound(self) -> str:
        if not self.memory_config:
            return "maxmemory unknown"
        if self.is_cluster:
            return "maxmemory per primary, summed" if self._max_bytes() else "a primary has maxmemory 0: unbounded"
        if self._max_bytes():
            return f"maxmemory (server-wide) with policy {self.memory_config.get('maxmemory-policy')}"
        return "maxmemory 0: unbounded"


class _RedisSource(_SequentialReads):
    def __init__(self, tier: RedisTier, name: str, size: int) -> None:
        self.tier, self.name, self.size = tier, name, size

    def readinto(self, offset: int, buffer: memoryview) -> int:
        if not len(buffer):
            return 0
        data = self.tier._call(lambda: self.tier.client.getrange(self.name, offset, offset + len(buffer) - 1), b"",
                               self.name)
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        return None
