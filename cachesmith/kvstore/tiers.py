"""Store tiers: byte stores holding serialized entries. Memory (LRU by bytes), disk (one file per
chunk, atomic writes, LRU by bytes within a quota: `disk_tier`, `disk_quota`), and redis
(`redis_tier`: shared across processes and machines, one server or a cluster).

Each tier answers `source(key)` with a `RangeSource` (or None), so one layer or a few rows can be read
without reading the rest. Failures to write return False and log; they never raise into serving.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict

from cachesmith.errors import InputError
from cachesmith.kvstore.disk_quota import TierUsage
from cachesmith.kvstore.sources import BytesSource, FileSource

__all__ = ["BytesSource", "FileSource", "MemoryTier", "Tier", "TierUsage"]

log = logging.getLogger(__name__)


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
