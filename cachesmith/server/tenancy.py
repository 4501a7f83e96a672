"""Tenants: who a request acts for, which store namespaces that gives it, and what it holds there.

In: an API key file (`read_api_keys`: lines `<tenant> <key>`, or bare keys of the one unnamed
tenant), a request's `Caller` (the tenant its key names and its `cache_salt`), and the entries the
server writes. Out: key -> tenant pairs for the auth check; `Namespaces`, where the caller's
private entries (prompt prefixes, conversations) and its document chunks live and which ones it
may see; and `TenantUsage`, the bytes each namespace holds, checked against a per-tenant cap:
`StoreUsage` counts them in this process; `redis_usage.RedisUsage` in redis, one count for every
server sharing it.

Without named tenants and salt every namespace is "", so entries key as they did before tenants
existed and the store's precomputed chunks are served. With chunks shared on purpose (a public
corpus), every tenant's document chunks live in one namespace, while prefixes and conversations
stay private.
"""
from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachesmith.errors import CachesmithError, ConfigError
from cachesmith.kvstore import ChunkStore
from cachesmith.kvstore.keys import namespace_of

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


class StoreQuotaExceeded(CachesmithError):
    """A request would add more to the store than a cap allows (a 429: nothing was stored)."""


@dataclass(frozen=True)
class Caller:
    """Who a request acts for: the tenant its API key names ("" without named tenants) and the
    `cache_salt` it sent (vLLM's field: requests under different salts share no stored KV)."""
    tenant: str = ""
    cache_salt: str = ""


@dataclass(frozen=True)
class Namespaces:
    own: str  # prompt prefixes and conversations: the tenant's alone
    chunks: str  # document chunks: `own`, or the one shared namespace

    @classmethod
    def of(cls, caller: Caller, is_chunk_shared: bool = False) -> Namespaces:
        own = namespace_of(caller.tenant, caller.cache_salt)
        return cls(own, namespace_of("", caller.cache_salt) if is_chunk_shared else own)

    def is_visible(self, namespace: str) -> bool:
        return namespace in (self.own, self.chunks)

    def is_shared(self, namespace: str) -> bool:
        """An entry every tenant reads (a shared document chunk), not this tenant's alone."""
        return namespace == self.chunks != self.own


def parse_api_keys(text: str, source: str = "api key file") -> tuple[tuple[str, str], ...]:
    """(key, tenant) pairs from the file's lines: `<tenant> <key>` names a tenant; a bare `<key>`
    is a key of the one unnamed tenant (several bare keys: rotation). Blank lines and `#` comments
    are skipped. A file mixes neither forms nor repeats a key."""
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):  # a key may hold '#': only whole lines are comments
            continue
        if len(fields) > 2:
            raise ConfigError(f"{source} line {number}: expected '<tenant> <key>' or a bare key, "
                              f"got {len(fields)} fields")
        tenant, key = (fields[0], fields[1]) if len(fields) == 2 else ("", fields[0])
        if tenant and not TENANT_NAME.match(tenant):
            raise ConfigError(f"{source} line {number}: tenant {tenant[:80]!r} must be 1-64 letters, digits "
                              f"or _.@- (starting with a letter or digit)")
        if any(key == k for k, _ in pairs):
            raise ConfigError(f"{source} line {number}: a key given twice (each key names one tenant)")
        pairs.append((key, tenant))
    if not pairs:
        raise ConfigError(f"{source}: holds no key")
    if len({bool(t) for _, t in pairs}) > 1:
        raise ConfigError(f"{source}: mixes bare keys with '<tenant> <key>' lines; once tenants are named, "
                          f"name the tenant of every key")
    return tuple(pairs)


def read_api_keys(path: Path) -> tuple[tuple[str, str], ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot be read ({exc})") from exc
    return parse_api_keys(text, f"--api-key-file {path}")


def quota_exceeded(what: str, num_bytes: int, cap: int) -> StoreQuotaExceeded:
    """The refusal of a write that would take a tenant's stored KV to `num_bytes`, past `cap`."""
    return StoreQuotaExceeded(f"{what}: storing it would take this tenant's stored KV to {num_bytes} bytes, "
                              f"past its quota of {cap} bytes (--tenant-max-bytes); delete chunks "
                              f"(DELETE /v1/chunks/{{id}}) or send fewer new documents")


class TenantUsage(ABC):
    """Bytes of the store's entries by namespace, for a cap per tenant."""
    is_shared = False  # whether every server sharing the store sees this count (else: this process's)

    @abstractmethod
    def used(self, namespace: str) -> int:
        """Bytes counted for `namespace` now."""

    @abstractmethod
    def reserve(self, namespace: str, new: dict[str, int], cap: int | None, what: str) -> None:
        """Count `new` entries (key -> bytes) for `namespace`, or raise `StoreQuotaExceeded` when
        they would take it past `cap` bytes (None: no cap), counting nothing."""

    @abstractmethod
    def forget(self, namespace: str, keys: Iterable[str]) -> None:
        """Stop counting `keys` of `namespace` (deleted)."""


class StoreUsage(TenantUsage):
    """Counted in this process: from the entries' headers when first asked about a namespace, then
    kept up to date with what this server writes and deletes; an entry evicted by a tier's quota, or
    deleted by another server, is noticed when a cap would refuse (the count is then checked against
    the store before refusing). Servers sharing a store each count on their own."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._bytes: dict[str, dict[str, int]] | None = None  # namespace -> key -> entry bytes

    def used(self, namespace: str) -> int:
        with self._lock:
            return sum(self._counts().get(namespace, {}).values())

    def reserve(self, namespace: str, new: dict[str, int], cap: int | None, what: str) -> None:
        with self._lock:
            held = self._counts().setdefault(namespace, {})
            fresh = {k: n for k, n in new.items() if k not in held}
            if cap is not None and sum(held.values()) + sum(fresh.values()) > cap:
                for key in [k for k in held if not self.store.contains(k)]:  # evicted or deleted elsewhere
                    del held[key]
                used = sum(held.values())
                if used + sum(fresh.values()) > cap:
                    raise quota_exceeded(what, used + sum(fresh.values()), cap)
            held.update(fresh)

    def forget(self, namespace: str, keys: Iterable[str]) -> None:
        with self._lock:
            held = self._counts().get(namespace, {})
            for key in keys:
                held.pop(key, None)

    def _counts(self) -> dict[str, dict[str, int]]:
        if self._bytes is None:  # the store as it stands: entries written before this server started
            self._bytes = {}
            for key in self.store.keys():
                described = self.store.describe(key)
                if described is not None:
                    header = described[0]
                    self._bytes.setdefault(header.namespace, {})[key] = header.total_bytes
        return self._bytes
