"""The tiered chunk store: reads through memory -> disk -> redis, fills faster tiers on the way back.

In: a model and a chunk's token ids (or a key). Out: verified entries (`EntryReader`) or `ChunkKV`s.
A corrupt, truncated or foreign entry is logged, evicted from the tier that held it, and treated as
a miss, so the caller recomputes the chunk instead of serving it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cachesmith.errors import CachesmithError, ConfigError
from cachesmith.kvstore.codec import CODECS
from cachesmith.kvstore.disk_quota import DEFAULT_DISK_FRACTION
from cachesmith.kvstore.entry_format import CorruptEntry, EntryHeader, serialize
from cachesmith.kvstore.keys import chunk_key, dtype_name, validate_key, validate_namespace
from cachesmith.kvstore.missed_writes import MissedWrites, WriteRetrier
from cachesmith.kvstore.reader import EntryReader, read_bytes
from cachesmith.kvstore.disk_tier import DiskTier
from cachesmith.kvstore.redis_tier import DEFAULT_REDIS_TTL_S, RedisTier
from cachesmith.kvstore.tiers import MemoryTier, Tier
from cachesmith.model import ChunkKV, Decoder, prefill_chunk
from cachesmith.model.assets import cachesmith_home

log = logging.getLogger(__name__)
Keyed = tuple[str, Sequence[int]]  # (namespace, token ids) a caller hashed into a key
TIER_NAMES = ("memory", "disk", "redis")
MISSED_WRITES_JOURNAL = "missed_writes.log"
DEFAULT_MEMORY_BYTES = 1 << 30  # the memory tier's bound where no server sized it (`server.memory_budget`)


@dataclass(frozen=True)
class StoreConfig:
    """Which tiers, and the bound of each: memory `memory_bytes` (None: `DEFAULT_MEMORY_BYTES`; a
    server sizes it to the machine); disk `disk_max_bytes` (None or 0:
    `DEFAULT_DISK_FRACTION` of the free space plus what the store holds, at start; LRU, entries in
    use kept); redis `redis_ttl_s` per entry (None: no expiry) and the redis server's `maxmemory`
    (`redis_max_bytes` sets it at start)."""

    tiers: tuple[str, ...] = ("memory", "disk")  # fastest first
    root: Path | None = None  # disk tier root; default $CACHESMITH_HOME/kv
    memory_bytes: int | None = None
    redis_url: str | None = None
    disk_max_bytes: int | None = None
    redis_ttl_s: int | None = DEFAULT_REDIS_TTL_S
    redis_max_bytes: int | None = None  # set as the redis server's maxmemory (allkeys-lru) at start
    retry_interval_s: float = 5.0  # how often writes a tier missed are tried again, while any are
    codec: str = "none"  # how new entries store their KV (`kvstore.codec`); their keys name it

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIER_NAMES]
        if unknown or not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"tiers={self.tiers!r}: each of {TIER_NAMES} at most once, at least one")
        if "redis" in self.tiers and not self.redis_url:
            raise ConfigError("tiers include 'redis' but redis_url is not set")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError(f"memory_bytes={self.memory_bytes} must be positive (None: the default)")
        if self.disk_max_bytes is not None and self.disk_max_bytes < 0:
            raise ConfigError(f"disk_max_bytes={self.disk_max_bytes} must be positive, or 0/None for the default "
                              f"({DEFAULT_DISK_FRACTION:.0%} of the free space plus what the store holds)")
        if self.redis_max_bytes is not None and self.redis_max_bytes < 1:
            raise ConfigError(f"redis_max_bytes={self.redis_max_bytes} must be positive (None: the server's own)")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise ConfigError(f"redis_ttl_s={self.redis_ttl_s} must be a positive number of seconds, "
                              f"or None for no expiry")
        if self.codec not in CODECS:
            raise ConfigError(f"codec={self.codec!r}: must be one of {', '.join(CODECS)}")
        if not 0 < self.retry_interval_s <= 3600:
            raise ConfigError(f"retry_interval_s={self.retry_interval_s} must be in (0, 3600] seconds")


@dataclass
class StoreStats:
    hits: Counter = field(default_factory=Counter)  # by tier name
    misses: int = 0
    evicted_corrupt: int = 0
    bytes_written: int = 0
    # per codec, the bytes and token rows of the entries this store wrote (one copy each)
    entry_bytes: Counter = field(default_factory=Counter)
    entry_tokens: Counter = field(default_factory=Counter)

    def bytes_per_token(self) -> dict[str, float]:
        """Stored bytes per token of the entries written, by codec."""
        return {codec: self.entry_bytes[codec] / n for codec, n in self.entry_tokens.items() if n}

    def hit_rate(self) -> float:
        total = sum(self.hits.values()) + self.misses
        return sum(self.hits.values()) / total if total else 0.0


class StoreWriteFailed(CachesmithError):
    """No tier could store an entry: the request that needs it cannot be served from the store."""


class ChunkStore:
    def __init__(self, config: StoreConfig | None = None, tiers: Sequence[Tier] | None = None) -> None:
        self.config = config or StoreConfig()
        self.tiers = list(tiers) if tiers is not None else self._build(self.config)
        self.stats = StoreStats()
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        # kept beside the disk tier's entries, so a restarted server still writes back what it missed
        self._missed = MissedWrites(disk and disk.root / MISSED_WRITES_JOURNAL, self.tiers)
        self._retrier = WriteRetrier(self.retry_missed_writes, lambda: len(self._missed) > 0,
                                     self.config.retry_interval_s)
        if len(self._missed):
            self._retrier.wake()
        for tier in self._shared():  # a chunk deleted through another server leaves this one too
            tier.watch_deletes(self._forget_locally)

    def _shared(self) -> list[RedisTier]:
        return [t for t in self.tiers if isinstance(t, RedisTier)]

    def _forget_locally(self, key: str) -> None:
        validate_key(key)
        for tier in self.tiers:
            if not isinstance(tier, RedisTier):
                tier.delete(key)

    def close(self) -> None:
        """Stop watching for deletes announced by other stores, and retrying missed writes."""
        self._retrier.close()
        for tier in self._shared():
            tier.close()

    @staticmethod
    def _build(cfg: StoreConfig) -> list[Tier]:
        memory_bytes = DEFAULT_MEMORY_BYTES if cfg.memory_bytes is None else cfg.memory_bytes
        makers = {"memory": lambda: MemoryTier(memory_bytes),
                  "disk": lambda: DiskTier(cfg.root or cachesmith_home() / "kv", cfg.disk_max_bytes),
                  "redis": lambda: RedisTier(cfg.redis_url, ttl_s=cfg.redis_ttl_s, max_bytes=cfg.redis_max_bytes)}
        return [makers[name]() for name in cfg.tiers]

    def key_for(self, model: Decoder, token_ids: Sequence[int], namespace: str = "") -> str:
        """The key of `token_ids`' entry in `namespace`, stored by this store's codec."""
        return chunk_key(model.fingerprint, dtype_name(model.dtype), token_ids, namespace, self.config.codec)

    def _verify(self, reader: EntryReader, key: str, model: Decoder | None, keyed: Keyed | None = None) -> None:
        """The entry is the one its key names, for `model`: its header's token ids, namespace and codec
        hash to the key. Where the caller keyed it (`keyed`: the namespace and token ids it hashed),
        they are compared instead of hashed again: a chunk is hashed once a request. Its header passed
        its crc32, and each block is checked by its checksum as it is read."""
        h = reader.header
        if keyed is not None:
            namespace, token_ids = keyed
            is_match = (h.key == key and h.namespace == namespace and h.codec == self.config.codec
                        and tuple(h.token_ids) == tuple(token_ids))
        else:
            is_match = h.key == key and chunk_key(h.model_fingerprint, h.dtype, h.token_ids, h.namespace, h.codec) == key
        if not is_match:
            raise CorruptEntry("entry does not match its key")
        if model is None:
            return
        cfg = model.config
        want = (model.fingerprint, dtype_name(model.dtype), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        got = (h.model_fingerprint, h.dtype, h.num_layers, h.num_kv_heads, h.head_dim)
        if got != want:
            raise CorruptEntry(f"entry is for (model, dtype, layers, kv heads, head dim) {got}, not {want}")

    def _evict(self, tier: Tier, key: str, exc: Exception) -> None:
        log.warning("store: %s entry %s is unusable (%s); evicted, it will be recomputed", tier.name, key[:12], exc)
        self.stats.evicted_corrupt += 1
        tier.delete(key)

    def open(self, key: str, model: Decoder | None = None, keyed: Keyed | None = None) -> EntryReader | None:
        """A verified reader from the fastest tier holding `key`, filling faster tiers on the way.
        `keyed`: the (namespace, token ids) its caller hashed into `key`, compared without hashing."""
        validate_key(key)
        reader = self._first_verified(key, model, self.tiers, keyed)
        if reader is None:
            self.stats.misses += 1
            return None
        self.stats.hits[reader.tier.name] += 1
        faster = self.tiers[:self.tiers.index(reader.tier)]
        if faster:
            self._fill(faster, key, reader.source)
        self._write_back(key, reader.source)
        return reader

    def _first_verified(self, key: str, model: Decoder | None, tiers: Sequence[Tier],
                        keyed: Keyed | None = None) -> EntryReader | None:
        """A verified reader from the first of `tiers` holding `key`; a holder whose entry fails
        verification on the way is evicted."""
        for tier in tiers:
            source = tier.source(key)
            if source is None:
                continue
            try:
                reader = EntryReader(source)
                self._verify(reader, key, model, keyed)
            except (CorruptEntry, ValueError, KeyError) as exc:
                source.close()
                self._evict(tier, key, exc)
                continue
            reader.tier = tier
            return reader
        return None

    @staticmethod
    def _fill(faster: Sequence[Tier], key: str, source) -> None:
        data = read_bytes(source, 0, source.size)
        if len(data) != source.size:  # the tier went away mid-read: a partial copy would only be evicted
            return
        for tier in faster:
            tier.put(key, data)

    def get(self, key: str, model: Decoder | None = None) -> ChunkKV | None:
        """The whole entry as a `ChunkKV` on `model`'s device (CPU without one), or None (a miss,
        or every holder was corrupt)."""
        device = model.device if model is not None else "cpu"
        for _ in self.tiers:
            reader = self.open(key, model)
            if reader is None:
                return None
            try:
                return reader.read_chunk(device)
            except CorruptEntry as exc:  # a data block failed: evict from that tier, try the next
                self._evict(reader.tier, key, exc)
            finally:
                reader.close()
        return None

    def put(self, chunk: ChunkKV, namespace: str = "", key: str | None = None) -> str:
        """Store `chunk` in every tier that takes it; its key (`key`: the caller's `key_for` of the
        same, not hashed again). A tier that cannot (full of entries in use, down, read-only) is
        skipped, and gets the entry when it is next read (`_write_back`)."""
        return self._put(chunk, namespace, key)[0]

    def _put(self, chunk: ChunkKV, namespace: str, key: str | None = None,
             is_replicated: bool = False) -> tuple[str, int]:
        validate_namespace(namespace)
        codec = self.config.codec
        key = key or chunk_key(chunk.model_fingerprint, dtype_name(chunk.dtype), chunk.token_ids, namespace, codec)
        data = serialize(key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values, namespace, codec)
        written = [self._write(tier, key, data, is_replicated) for tier in self.tiers]
        self.stats.bytes_written += len(data) * sum(written)
        if any(written):
            self.stats.entry_bytes[codec] += len(data)
            self.stats.entry_tokens[codec] += chunk.num_tokens
        missed = [t for t, ok in zip(self.tiers, written) if not ok]
        self._missed.note(key, missed)
        if missed:
            self._retrier.wake()
        return key, sum(written)

    def _write_back(self, key: str, source) -> None:
        """A tier that could not take `key` when it was stored (redis down, a read-only disk) gets it
        now, from the verified copy just opened: what was stored while a shared tier was away
        reaches it when the entry is next read, instead of living only where it was first written."""
        missing = self._missed.tiers_of(key)
        if not missing:
            return
        data = read_bytes(source, 0, source.size)
        if len(data) == source.size:
            self._missed.note(key, [t for t in missing if not t.put(key, data)], is_retry=True)

    def retry_missed_writes(self) -> int:
        """Write each entry a tier missed to that tier, from a verified copy another tier holds,
        without waiting for the entry's next read (the retrier's pass while a tier was away).
        Returns how many entries now sit in every tier that had missed them."""
        num_done, pending = 0, self._missed.items()
        missed_tiers = {t.name: t for _, missing in pending for t in missing}
        up = {name for name, tier in missed_tiers.items() if tier.is_up}  # one check per tier per pass
        for key, missing in pending:
            if not any(t.name in up for t in missing):
                continue  # its tiers are still away: nothing read, nothing sent
            holders = [t for t in self.tiers if t not in missing]
            reader = self._first_verified(key, None, holders)
            if reader is None:  # gone from every tier that held it: nothing left to write
                self._missed.forget(key)
                continue
            try:
                self._write_back(key, reader.source)
            finally:
                reader.close()
            num_done += not self._missed.tiers_of(key)
        self._missed.compact()
        return num_done

    def contains(self, key: str) -> bool:
        validate_key(key)
        return any(t.contains(key) for t in self.tiers)

    def delete(self, key: str) -> list[str]:
        """Delete `key` from every tier, slowest (shared) first, so a tier that cannot delete it now
        stops the delete where the faster copies still agree with it. Returns the names of the tiers
        that could not (empty: gone everywhere, and announced to the other stores)."""
        validate_key(key)
        deleted: list[Tier] = []
        for tier in reversed(self.tiers):
            if not tier.delete(key):
                self._restore(tier, key, deleted)
                return [tier.name]
            deleted.append(tier)
        self._missed.forget(key)
        for tier in self._shared():
            tier.announce_delete(key)
        return []

    def _restore(self, holder: Tier, key: str, deleted: list[Tier]) -> None:
        """A delete stopped at `holder` (read-only, down): put the entry back into the slower tiers it
        was already deleted from, from the copy `holder` still has, so it stays as durable as it was
        stored (its client is told it is still stored; a disk tier alone would evict it by quota)."""
        if not deleted:
            return
        source = holder.source(key)
        if source is None:
            return
        try:
            self._fill(deleted, key, source)
        finally:
            source.close()

    def demote(self, key: str) -> bool:
        """Drop `key` from the fastest tier where a slower tier keeps it, so the next read comes from
        the slower one (and fills the fastest again). Whether it was dropped."""
        validate_key(key)
        fastest, slower = self.tiers[0], self.tiers[1:]
        if not fastest.contains(key) or not any(t.contains(key) for t in slower):
            return False
        fastest.delete(key)
        return True

    def describe(self, key: str) -> tuple[EntryHeader, tuple[str, ...]] | None:
        """(header, names of the tiers holding it) without counting a hit or filling tiers; None if
        no tier holds a readable entry. Listing uses this, so foreign entries are never evicted."""
        validate_key(key)
        header, holders = None, []
        for tier in self.tiers:
            source = tier.source(key)
            if source is None:
                continue
            try:
                found = EntryReader(source).header
            except (CorruptEntry, ValueError, KeyError):
                continue
            finally:
                source.close()
            header = header or found
            holders.append(tier.name)
        return None if header is None else (header, tuple(holders))

    def keys(self) -> list[str]:
        """Every key some tier holds (any model: `open(key, model)` tells which are this model's)."""
        return sorted(set().union(*(t.keys() for t in self.tiers)))

    def ensure(self, model: Decoder, token_ids: Sequence[int], namespace: str = "",
               key: str | None = None, is_replicated: bool = False) -> tuple[str, bool]:
        """Key of a stored, verified entry for `token_ids` in `namespace`, computing and storing it
        on a miss. Returns (key, was_computed). `key`: the caller's `key_for` of the same three,
        not hashed again. `is_replicated`: a shared tier with replicas holds it on one of them too
        before this returns (`StoreWriteFailed` otherwise): an entry named only by its id (an
        upload) has no text to rebuild it from, so a failover must not lose it."""
        key = key or self.key_for(model, token_ids, namespace)
        reader = self.open(key, model)
        if reader is None:
            return self._prefill(model, token_ids, namespace, key, is_replicated)
        try:
            if is_replicated:  # stored unreplicated before (for a request): written again, waited for
                data = read_bytes(reader.source, 0, reader.source.size)
                for tier in self.tiers:
                    if hasattr(tier, "put_replicated"):
                        self._write(tier, key, data, True)
        finally:
            reader.close()
        return key, False

    @staticmethod
    def _write(tier: Tier, key: str, data: bytes, is_replicated: bool) -> bool:
        """`tier.put`, or where a replica's copy is asked for and the tier has replicas, its
        `put_replicated`: `StoreWriteFailed` when no replica confirmed."""
        if not (is_replicated and hasattr(tier, "put_replicated")):
            return tier.put(key, data)
        confirmed = tier.put_replicated(key, data)
        if confirmed is False:
            raise StoreWriteFailed(f"chunk {key[:12]}: the {tier.name} tier did not confirm a replica's copy "
                                   f"within its wait (an upload is acknowledged once a failover cannot lose it)")
        return confirmed is True

    def ensure_held(self, model: Decoder, token_ids: Sequence[int], namespace: str = "",
                    key: str | None = None) -> tuple[str, bool]:
        """`ensure`, taking a tier's word that it holds the entry: a request's entry is opened and
        verified once, where staging reads it (one found corrupt there is evicted and prefilled again
        from the request's sources), not also when the request is admitted."""
        key = key or self.key_for(model, token_ids, namespace)
        if self.contains(key):
            return key, False
        return self._prefill(model, token_ids, namespace, key)

    def _prefill(self, model: Decoder, token_ids: Sequence[int], namespace: str, key: str,
                 is_replicated: bool = False) -> tuple[str, bool]:
        if not self._put(prefill_chunk(model, list(token_ids)), namespace, key, is_replicated)[1]:
            raise StoreWriteFailed(f"chunk {key[:12]}: no store tier took its KV ({', '.join(t.name for t in self.tiers)}: "
                                   f"full of entries in use, read-only or down)")
        return key, True
