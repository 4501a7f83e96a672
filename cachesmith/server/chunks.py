"""A tenant's view of the chunk store: what the serving front stores, shows and deletes for a caller.

In: a `Caller` (tenant, cache_salt), document texts or token ids, chunk ids. Out: chunk keys in the
caller's namespaces (`Namespaces`), `ChunkRecord`s of the entries the caller may see, and refusals:
`UnknownChunk` for an id the caller may not see (in the same words as one nobody stored, so an
entry's existence is never told across tenants), `ChunkInUse` for deleting what an in-flight
request reads, `SharedChunk` for deleting a chunk every tenant reads, `StoreUnavailable` for a
delete a store tier cannot do now, and `StoreQuotaExceeded`
before anything is written past a cap (the new tokens of one request, the bytes of one tenant).
Owns the pins that keep an in-flight request's entries from being deleted under it.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from cachesmith.kvstore import ChunkStore
from cachesmith.kvstore.entry_format import ELEMENT_BYTES, EntryHeader
from cachesmith.kvstore.keys import dtype_name, validate_key
from cachesmith.pipeline import RagPipeline
from cachesmith.server.specs import (ChunkInUse, ChunkRecord, ServiceConfig, SharedChunk, StoreUnavailable,
                                     UnknownChunk)
from cachesmith.server.redis_usage import tenant_usage
from cachesmith.server.tenancy import Caller, Namespaces, StoreQuotaExceeded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewEntry:
    """An entry a request is about to store (not yet in the store)."""
    namespace: str
    key: str
    num_tokens: int


class ChunkCatalog:
    def __init__(self, pipeline: RagPipeline, config: ServiceConfig,
                 admission: Callable[[], AbstractContextManager]) -> None:
        self.pipeline, self.config, self.admission = pipeline, config, admission
        self.usage = tenant_usage(pipeline.store)
        if config.tenant_max_bytes is not None:
            _log_cap_scope(config.tenant_max_bytes, self.usage.is_shared)
        self._pins: Counter = Counter()
        self._pin_lock = threading.Lock()
        cfg = pipeline.model.config
        self.bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * \
            ELEMENT_BYTES[dtype_name(pipeline.model.dtype)]

    @property
    def store(self) -> ChunkStore:
        return self.pipeline.store

    def namespaces(self, caller: Caller) -> Namespaces:
        return Namespaces.of(caller, self.config.is_chunk_shared)

    def key_for(self, token_ids: Sequence[int], namespace: str) -> str:
        return self.store.key_for(self.pipeline.model, token_ids, namespace)

    # -- caps ----------------------------------------------------------------------------------
    def new_entries(self, wanted: Sequence[NewEntry]) -> list[NewEntry]:
        """Of the entries a request would store, those the store does not hold yet (once each)."""
        out: dict[str, NewEntry] = {}
        for entry in wanted:
            if entry.key not in out and not self.store.contains(entry.key):
                out[entry.key] = entry
        return list(out.values())

    def entry(self, token_ids: Sequence[int], namespace: str) -> NewEntry:
        """The entry of `token_ids` in `namespace`: keyed here, once for the whole request."""
        return NewEntry(namespace, self.key_for(token_ids, namespace), len(token_ids))

    def reserve(self, entries: Sequence[NewEntry], spaces: Namespaces, what: str) -> None:
        """Refuse (`StoreQuotaExceeded`) before anything is written when storing `entries` would
        pass the tenant's byte cap; else count them. A request's own token cap is
        `check_new_tokens`, which its caller says first."""
        if self.config.tenant_max_bytes is None:
            return
        for namespace in {e.namespace for e in entries}:
            if spaces.is_shared(namespace):
                continue  # a public corpus belongs to no tenant: the disk quota bounds it
            new = {e.key: e.num_tokens * self.bytes_per_token for e in entries if e.namespace == namespace}
            self.usage.reserve(namespace, new, self.config.tenant_max_bytes, what)

    def check_new_tokens(self, entries: Sequence[NewEntry], what: str) -> None:
        """`StoreQuotaExceeded` when `entries` pass the new tokens one request may store: checked
        before any other refusal, since no retry would pass it."""
        num_tokens = sum(e.num_tokens for e in entries)
        limit = self.config.max_store_tokens_per_request
        if num_tokens > limit:
            raise StoreQuotaExceeded(f"{what}: {num_tokens} tokens not yet stored exceed the limit of {limit} "
                                     f"new tokens a request may store (--max-store-tokens-per-request); "
                                     f"send fewer or shorter new documents per request")

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, keys: Sequence[str], pinned: list[str]) -> None:
        with self._pin_lock:
            for key in keys:
                self._pins[key] += 1
                pinned.append(key)

    def unpin(self, keys: Sequence[str]) -> None:
        with self._pin_lock:
            for key in keys:
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    # -- what a caller sees --------------------------------------------------------------------
    def header(self, chunk_id: str, spaces: Namespaces) -> tuple[EntryHeader, tuple[str, ...]] | None:
        """A stored entry of this model the caller may see (header, tiers holding it), or None."""
        validate_key(chunk_id, field="chunk id")
        described = self.store.describe(chunk_id)
        if described is None:
            return None
        header, tiers = described
        model = self.pipeline.model
        if (header.model_fingerprint, header.dtype) != (model.fingerprint, dtype_name(model.dtype)):
            return None  # another model's entry: not this server's to show
        return described if spaces.is_visible(header.namespace) else None

    def record(self, chunk_id: str, caller: Caller) -> ChunkRecord | None:
        spaces = self.namespaces(caller)
        found = self.header(chunk_id, spaces)
        if found is None:
            return None
        header, tiers = found
        return ChunkRecord(chunk_id, header.num_tokens, tiers, self.pipeline.tokenizer.decode(header.token_ids),
                           is_shared=spaces.is_shared(header.namespace))

    def list(self, caller: Caller, limit: int, after: str | None) -> tuple[list[ChunkRecord], bool]:
        records = []
        for key in self.store.keys():
            if after is not None and key <= after:
                continue
            record = self.record(key, caller)
            if record is None:
                continue
            if len(records) == limit:
                return records, True
            records.append(record)
        return records, False

    def delete(self, chunk_id: str, caller: Caller) -> bool:
        spaces = self.namespaces(caller)
        found = self.header(chunk_id, spaces)
        if found is None:
            return False
        if spaces.is_shared(found[0].namespace):
            raise SharedChunk(f"chunk {chunk_id}: shared by every tenant (the server shares document chunks); "
                              f"the operator removes shared chunks (cachesmith store prune)")
        with self._pin_lock:
            if self._pins[chunk_id] > 0:
                raise ChunkInUse(f"chunk {chunk_id}: in use by {self._pins[chunk_id]} in-flight request(s); "
                                 f"delete it when they are done")
            failed = self.store.delete(chunk_id)
        if failed:
            raise StoreUnavailable(f"chunk {chunk_id}: the store's {failed[0]} tier cannot delete it now (down or "
                                   f"read-only); it is still stored: retry the delete")
        self.usage.forget(found[0].namespace, [chunk_id])
        return True

    def check_known(self, chunk_id: str, spaces: Namespaces, field: str) -> int:
        """Token count of a stored chunk a document names, or `UnknownChunk`."""
        found = self.header(chunk_id, spaces)
        if found is None:
            raise UnknownChunk(f"{field}={chunk_id!r}: unknown chunk id (not in the store; add it with "
                               f"POST /v1/chunks)")
        return found[0].num_tokens


def _log_cap_scope(cap: int, is_shared: bool) -> None:
    """Say at start how far the tenant cap holds: an operator running several servers on one store
    must know whether each of them allows a tenant the whole cap."""
    if is_shared:
        log.info("--tenant-max-bytes %d: each tenant's stored bytes are counted in the store's redis, one count "
                 "for every server sharing it", cap)
    else:
        log.warning("--tenant-max-bytes %d is counted per server process (the store has no redis tier): servers "
                    "sharing a store each allow a tenant the whole cap", cap)
