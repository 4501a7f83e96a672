"""Store tiers: byte stores holding serialized entries. Memory (LRU by bytes), disk (one file per
chunk, atomic writes, LRU by bytes within a quota: `disk_tier`, `disk_quota`), and redis (shared across processes
and machines; entries expire after a TTL, and the server's `maxmemory` bounds its bytes).

Each tier answers `source(key)` with a `RangeSource` (or None), so one layer or a few rows can be read
without reading the rest. Failures to write return False and log; they never raise into serving.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict

from cachesmith.errors import InputError
from cachesmith.kvstore.disk_quota import TierUsage
from cachesmith.kvstore.keys import validate_key
from cachesmith.kvstore.redis_memory import memory_config
from cachesmith.kvstore.sources import BytesSource, FileSource, _SequentialReads

__all__ = ["BytesSource", "FileSource", "MemoryTier", "RedisTier", "Tier", "TierUsage"]

log = logging.getLogger(__name__)
DEFAULT_REDIS_TTL_S = 7 * 24 * 3600  # an entry nobody read for a week is recomputed when next needed
REDIS_RETRY_AFTER_S = 5.0  # a redis tier that failed is tried again after this


class Tier(ABC):
    name: str

    @abstractmethod
    def source(self, key: str): ...

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the entry; False when the tier cannot now (down, read-only): it may still hold it."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> list[str]:
        """Every key this tier holds, sorted."""

    def usage(self) -> TierUsage:
        """Entries, bytes and the byte bound, for `cachesmith store stats` (here: by opening each)."""
        sizes = []
        for key in self.keys():
            source = self.source(key)
            if source is not None:
                sizes.append(source.size)
                source.close()
        return TierUsage(self.name, len(sizes), sum(sizes), None)

    @property
    def is_up(self) -> bool:
        """Whether the tier can serve now; the store-tier-up gauge reads it at scrape time."""
        return True


class MemoryTier(Tier):
    name = "memory"

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        if max_bytes <= 0:
            raise InputError(f"memory tier max_bytes={max_bytes} must be positive")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def source(self, key: str):
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                return None
            self._entries.move_to_end(key)
        return BytesSource(data)

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            return False
        with self._lock:
            if key in self._entries:
                self.num_bytes -= len(self._entries.pop(key))
            self._entries[key] = data
            self.num_bytes += len(data)
            while self.num_bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.num_bytes -= len(old)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is not None:
                self.num_bytes -= len(data)
        return True

    def contains(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.name, len(self._entries), self.num_bytes, self.max_bytes,
                             note="this process's own")


class RedisTier(Tier):
    """Entries as redis strings; GETRANGE reads a layer or a row range. Unreachable -> warn, skip:
    every call then answers as an empty tier, so the store serves from its local tiers.

    Bounds: each entry expires `ttl_s` after its last write or open (None: never). Bytes are bounded
    by the redis server's own `maxmemory` with `maxmemory-policy allkeys-lru`, not here: the tier
    cannot see what other servers write. `max_bytes` sets them at start; without it a server
    reporting `maxmemory 0` is warned about (`redis_memory`)."""

    name = "redis"
    PREFIX = "cachesmith:kv:"
    DELETED = "cachesmith:kv-deleted"  # pub/sub channel: keys deleted through any server

    def __init__(self, url: str, retry_after_s: float = REDIS_RETRY_AFTER_S, timeout_s: float = 2.0,
                 ttl_s: int | None = DEFAULT_REDIS_TTL_S, max_bytes: int | None = None) -> None:
        import redis

        if ttl_s is not None and ttl_s <= 0:
            raise InputError(f"redis tier ttl_s={ttl_s} must be a positive number of seconds (None: no expiry)")
        self.ttl_s = ttl_s

        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._unreachable = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._refused = redis.exceptions.RedisError
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self.memory_config = memory_config(self.client, url, ttl_s, (self._refused, OSError), max_bytes)

    @property
    def is_available(self) -> bool:
        """False while backing off after a failure (no reconnect storm)."""
        return time.monotonic() >= self._down_until

    @property
    def is_up(self) -> bool:
        # a PING, so a server that went away while no request touched it still reads as down;
        # while backing off no PING is sent, so a scrape never hammers a dead server
        return self.is_available and bool(self._call(self.client.ping, False))

    def _call(self, fn, default):
        if not self.is_available:
            return default
        try:
            return fn()
        except self._unreachable as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            log.warning("redis tier %s unreachable (%s); using local tiers for %.0f s",
                        self.url, exc, self.retry_after_s)
        except self._refused as exc:  # reachable but refused the command (out of memory, read-only)
            log.warning("redis tier %s refused a command (%s); skipped", self.url, exc)
        return default

    def source(self, key: str):
        name = self.PREFIX + validate_key(key)
        size = self._call(lambda: self._size_and_refresh(name), 0)
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
        return bool(self._call(lambda: self.client.set(name, data, ex=self.ttl_s), False))

    def delete(self, key: str) -> bool:
        return self._call(lambda: self.client.delete(self.PREFIX + validate_key(key)), None) is not None

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self.client.exists(self.PREFIX + validate_key(key)), 0))

    def announce_delete(self, key: str) -> None:
        """Tell every store on this redis that a client deleted `key`, so they drop their local
        copies (a corrupt entry's eviction is not announced: other copies may be sound)."""
        self._call(lambda: self.client.publish(self.DELETED, validate_key(key)), 0)

    def watch_deletes(self, forget) -> None:
        """Call `forget(key)` for every key announced deleted, on a daemon thread, until `close()`.
        Deletes announced while this store was cut off from redis are missed (pub/sub keeps nothing)."""
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, args=(forget,), daemon=True,
                                              name="cachesmith-redis-deletes")
            self._listener.start()

    def _listen(self, forget) -> None:
        while not self._closed.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.DELETED)
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message and message["type"] == "message":
                        data = message["data"]
                        forget(data.decode() if isinstance(data, bytes) else data)
            except self._unreachable:
                self._closed.wait(self.retry_after_s)  # the outage itself is logged by the tier's calls
            except Exception:  # a bad message must not end the watch
                log.exception("redis tier %s: a delete announcement failed", self.url)
            finally:
                pubsub.close()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.join(timeout=5)

    def keys(self) -> list[str]:
        names = self._call(lambda: list(self.client.scan_iter(match=self.PREFIX + "*", count=1000)), [])
        return sorted(n.decode()[len(self.PREFIX):] if isinstance(n, bytes) else n[len(self.PREFIX):]
                      for n in names)

    def usage(self) -> TierUsage:
        names = [self.PREFIX + key for key in self.keys()]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        sizes = self._call(pipe.execute, []) if names else []
        max_bytes = int(self.memory_config.get("maxmemory", 0)) or None
        bound = (f"maxmemory (server-wide) with policy {self.memory_config.get('maxmemory-policy')}"
                 if max_bytes else "maxmemory 0: unbounded" if self.memory_config else "maxmemory unknown")
        return TierUsage(self.name, len(sizes), sum(sizes), max_bytes, note=f"{bound}; ttl_s={self.ttl_s}")


class _RedisSource(_SequentialReads):
    def __init__(self, tier: RedisTier, name: str, size: int) -> None:
        self.tier, self.name, self.size = tier, name, size

    def readinto(self, offset: int, buffer: memoryview) -> int:
        if not len(buffer):
            return 0
        data = self.tier._call(lambda: self.tier.client.getrange(self.name, offset, offset + len(buffer) - 1), b"")
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        return None
