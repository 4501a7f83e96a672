"""A tenant's stored bytes counted in redis, so every server sharing the store's redis holds one cap.

In: the store's redis tier (its client, entry names, back-off), a namespace's new entries (key ->
bytes) with a cap, and deleted keys. Out: reservations that pass, or `StoreQuotaExceeded` with
nothing counted. Each check-and-count runs as one Lua script on the redis server, so two servers
racing for a tenant's last bytes cannot both pass. A script touches only the namespace's two hashes,
passed as KEYS and tagged to one slot, so it runs on a Redis Cluster too; the entries it asks about
live in slots of their own and are looked up first, by the server (`_exist`). `tenant_usage`
picks this count or the per-process `StoreUsage` from the store's tiers.

Redis keys, per namespace `<ns>` ("-" for the empty one):
- `cachesmith:tenant-bytes:{<ns>}`: a hash, entry key -> bytes, and field `total`, their sum;
- `cachesmith:tenant-bytes-pending:{<ns>}`: a hash, entry key -> when it was reserved (ms, redis's
  clock), for entries reserved and not yet seen in redis (being prefilled).

An entry counts while redis holds it, so it follows the tier's TTL and `maxmemory` eviction: a
reservation is confirmed once its entry is in redis, and dropped when none is there
`PENDING_GRACE_S` after it was made (its write failed). Before a cap refuses, every confirmed entry
gone from redis (expired, evicted) is dropped, so a cap never refuses on bytes that are gone. A
delete through any server takes its bytes off at once. Entries stored before any server counted
(an older version, a server without a cap) are counted once per redis, by the first server to
reserve (`seed`: reading their headers restarts their TTLs).

Redis away (the tier backing off, or a call failing): the cap is counted per process, by a fresh
`StoreUsage` over the tiers this server reaches, logged once per outage; what it reserved meanwhile
is added to the redis count when redis answers again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from cachesmith.kvstore import ChunkStore
from cachesmith.kvstore.entry_format import CorruptEntry, EntryHeader
from cachesmith.kvstore.reader import EntryReader
from cachesmith.kvstore.redis_tier import RedisTier
from cachesmith.server.tenancy import StoreUsage, TenantUsage, quota_exceeded

log = logging.getLogger(__name__)
COUNTS = "cachesmith:tenant-bytes:"
PENDING = "cachesmith:tenant-bytes-pending:"
SEEDED = "cachesmith:tenant-bytes-seeded:2"  # set once the store's earlier entries are counted (2: tagged counts)
SEEDING = "cachesmith:tenant-bytes-seeding"  # held by the server counting them
PENDING_GRACE_S = 600  # a reserved entry not in redis by then was never written: its bytes are freed
SEEDING_LOCK_S = 300  # a server that died while counting leaves the work to the next after this

# drop one entry from a namespace's count (and its pending reservation, if any)
_DROP = """
local function drop(counts, pending, key)
  local n = redis.call('HGET', counts, key)
  redis.call('HDEL', pending, key)
  if n then
    redis.call('HDEL', counts, key)
    redis.call('HINCRBY', counts, 'total', -tonumber(n))
  end
end
"""

# KEYS: counts, pending (one hash tag: one slot on a cluster). ARGV: cap (-1: none), grace ms, swept
# (1: the entries found gone are listed), then a count and that many pending entries found written,
# a count and that many counted entries found gone, then key, bytes pairs. Entries live in slots of
# their own, so the caller looks them up and passes what it saw: a script touches only its KEYS.
# Returns {passed (1/0), bytes counted before, new bytes, a sweep would be needed (1/0)}.
RESERVE = _DROP + """
local counts, pending = KEYS[1], KEYS[2]
local cap, grace, swept = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local written, n = {}, tonumber(ARGV[4])
for i = 5, 4 + n do written[ARGV[i]] = true end
local at = 5 + n
local gone, m = {}, tonumber(ARGV[at])
for i = at + 1, at + m do table.insert(gone, ARGV[i]) end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local held = redis.call('HGETALL', pending)
for i = 1, #held, 2 do
  if written[held[i]] then
    redis.call('HDEL', pending, held[i])
  elseif now - tonumber(held[i + 1]) > grace then
    drop(counts, pending, held[i])
  end
end
local fresh, num_fresh = {}, 0
for i = at + m + 1, #ARGV, 2 do
  if redis.call('HEXISTS', counts, ARGV[i]) == 0 then
    table.insert(fresh, i)
    num_fresh = num_fresh + tonumber(ARGV[i + 1])
  end
end
local used = tonumber(redis.call('HGET', counts, 'total') or '0')
if cap >= 0 and used + num_fresh > cap then
  if swept == 0 then return {0, used, num_fresh, 1} end
  for _, key in ipairs(gone) do
    if redis.call('HEXISTS', pending, key) == 0 then drop(counts, pending, key) end
  end
  used = tonumber(redis.call('HGET', counts, 'total') or '0')
  if used + num_fresh > cap then return {0, used, num_fresh, 0} end
end
for _, i in ipairs(fresh) do
  redis.call('HSET', counts, ARGV[i], ARGV[i + 1])
  redis.call('HSET', pending, ARGV[i], now)
end
redis.call('HINCRBY', counts, 'total', num_fresh)
return {1, used, num_fresh, 0}
"""

# KEYS: counts, pending. ARGV: keys deleted.
FORGET = _DROP + """
for i = 1, #ARGV do drop(KEYS[1], KEYS[2], ARGV[i]) end
return 0
"""

# KEYS: counts. ARGV: key, bytes pairs of entries already in redis (counted unless they are).
SEED = """
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('HINCRBY', KEYS[1], 'total', ARGV[i + 1])
  end
end
return 0
"""


def counts_key(namespace: str) -> str:
    return COUNTS + _tag(namespace)


def pending_key(namespace: str) -> str:
    return PENDING + _tag(namespace)


def _tag(namespace: str) -> str:
    """The namespace as a hash tag: its count and pending hashes share a slot on a cluster (a
    namespace is empty or 32 hex digits: `kvstore.keys.validate_namespace`)."""
    return "{" + (namespace or "-") + "}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def tenant_usage(store: ChunkStore) -> TenantUsage:
    """Counted in redis where the store has a redis tier (shared by every server on it), else in
    this process."""
    tier = next((t for t in store.tiers if isinstance(t, RedisTier)), None)
    return StoreUsage(store) if tier is None else RedisUsage(store, tier)


class RedisUsage(TenantUsage):
    """One count per namespace in the store's redis, for every server sharing it (module docstring)."""
    is_shared = True

    def __init__(self, store: ChunkStore, tier: RedisTier) -> None:
        import redis

        self.store, self.tier = store, tier
        self._failed = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
        self._scripts: tuple | None = None  # registered once the tier has a client: a server starts while redis is away
        self._lock = threading.Lock()
        self.local: StoreUsage | None = None  # the per-process count while redis is away
        self._down_until = 0.0
        self._is_seeded = False
        self._unsynced: dict[str, dict[str, int]] = {}  # reserved while redis was away

    def used(self, namespace: str) -> int:
        found = self._redis(lambda: self.tier.client.hget(counts_key(namespace), "total"))
        if found is _AWAY:
            return self._local().used(namespace)
        return int(found or 0)

    def reserve(self, namespace: str, new: dict[str, int], cap: int | None, what: str) -> None:
        answer = self._redis(lambda: self._reserve_in_redis(namespace, new, cap))
        if answer is _AWAY:
            self._local().reserve(namespace, new, cap, what)
            with self._lock:
                self._unsynced.setdefault(namespace, {}).update(new)
            return
        is_passed, num_used, num_new = (int(x) for x in answer)
        if not is_passed:
            raise quota_exceeded(what, num_used + num_new, cap)

    def forget(self, namespace: str, keys: Iterable[str]) -> None:
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._unsynced.get(namespace, {}).pop(key, None)
        done = self._redis(lambda: self._script(1)(keys=[counts_key(namespace), pending_key(namespace)], args=keys))
        if done is _AWAY:  # a count left in redis is dropped when a cap would refuse (its entry is gone)
            self._local().forget(namespace, keys)

    def _reserve_in_redis(self, namespace: str, new: dict[str, int], cap: int | None) -> list:
        """The reservation in one script on the namespace's slot; the entries it asks about (pending
        ones written since, counted ones gone when a cap would refuse) looked up first, where they live."""
        keys, client = [counts_key(namespace), pending_key(namespace)], self.tier.client
        written = [k for k, here in self._exist(list(map(_text, client.hkeys(keys[1])))) if here]
        answer = self._script(0)(keys=keys, args=_reserve_args(cap, 0, written, [], new))
        if int(answer[0]) or not int(answer[3]):
            return answer[:3]
        counted = [k for k in map(_text, client.hkeys(keys[0])) if k != "total"]
        gone = [k for k, here in self._exist(counted) if not here]
        return self._script(0)(keys=keys, args=_reserve_args(cap, 1, written, gone, new))[:3]

    def _exist(self, keys: list[str]) -> list[tuple[str, bool]]:
        """(key, whether redis holds its entry), each asked of the node holding it."""
        if not keys:
            return []
        pipe = self.tier.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(RedisTier.PREFIX + key)
        return list(zip(keys, (bool(x) for x in pipe.execute())))

    def _script(self, index: int):
        """RESERVE, FORGET or SEED, registered with the tier's client."""
        if self._scripts is None:
            self._scripts = tuple(self.tier.client.register_script(s) for s in (RESERVE, FORGET, SEED))
        return self._scripts[index]

    # -- redis away and back ---------------------------------------------------------------------
    def _redis(self, call: Callable[[], object]):
        """`call()` against redis, after catching up on what redis missed; `_AWAY` while redis is
        away (the tier backing off, or this call failing)."""
        if not self.tier.is_available or time.monotonic() < self._down_until or not self.tier.connected():
            self._went_away("the store's redis tier is backing off")
            return _AWAY
        try:
            self._catch_up()
            return call()
        except self._failed as exc:
            self._down_until = time.monotonic() + self.tier.retry_after_s
            self._went_away(exc)
            return _AWAY

    def _went_away(self, why) -> None:
        with self._lock:
            is_new = self.local is None
            if is_new:  # counted afresh from the tiers this server reaches
                self.local = StoreUsage(self.store)
        if is_new:  # once per outage
            log.warning("tenant caps: redis %s is away (%s); each tenant's bytes are counted by this server alone "
                        "until it answers (the cap is per process meanwhile)", self.tier.url, why)

    def _local(self) -> StoreUsage:
        with self._lock:
            if self.local is None:  # redis came back since `_redis` answered away
                self.local = StoreUsage(self.store)
            return self.local

    def _catch_up(self) -> None:
        """Count the store's earlier entries (once), and what was reserved while redis was away."""
        if not self._is_seeded:
            self.seed()
        with self._lock:
            unsynced, self._unsynced = self._unsynced, {}
        try:
            for namespace, new in unsynced.items():
                self._reserve_in_redis(namespace, new, None)
        except self._failed:
            with self._lock:  # kept for the next try
                for namespace, new in unsynced.items():
                    self._unsynced.setdefault(namespace, {}).update(new)
            raise
        with self._lock:
            was_away, self.local = self.local is not None, None
        if was_away:
            log.info("tenant caps: redis %s answers again; each tenant's bytes are counted there, for every "
                     "server sharing it", self.tier.url)

    def seed(self) -> None:
        """Count the entries redis held before any server counted them, unless another server has
        (or is doing it now)."""
        client = self.tier.client
        if client.exists(SEEDED) or not client.set(SEEDING, 1, nx=True, ex=SEEDING_LOCK_S):
            self._is_seeded = True
            return
        by_namespace: dict[str, list] = {}
        for name in client.scan_iter(match=RedisTier.PREFIX + "*", count=1000):
            key = (name.decode() if isinstance(name, bytes) else name)[len(RedisTier.PREFIX):]
            header = self._header(key)
            if header is not None:
                by_namespace.setdefault(header.namespace, []).extend((key, header.total_bytes))
        for namespace, pairs in by_namespace.items():
            self._script(2)(keys=[counts_key(namespace)], args=pairs)
        client.set(SEEDED, 1)
        client.delete(SEEDING)
        self._is_seeded = True

    def _header(self, key: str) -> EntryHeader | None:
        source = self.tier.source(key)
        if source is None:
            return None
        try:
            return EntryReader(source).header
        except (CorruptEntry, ValueError, KeyError):  # not an entry the store would serve: not counted
            return None
        finally:
            source.close()


def _reserve_args(cap: int | None, swept: int, written: list[str], gone: list[str], new: dict[str, int]) -> list:
    args = [-1 if cap is None else cap, PENDING_GRACE_S * 1000, swept, len(written), *written, len(gone), *gone]
    for key, num_bytes in new.items():
        args += [key, num_bytes]
    return args


_AWAY = object()  # a redis call's answer while redis is away
