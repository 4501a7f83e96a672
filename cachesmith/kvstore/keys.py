"""Content addresses of chunk KV entries: sha256 over (model fingerprint, dtype, namespace, codec,
token ids).

A stored cache is never served for another model, dtype, namespace, codec or token sequence because
all five are in the key, and the entry's header repeats them for verification on read. A namespace
keeps tenants apart: equal text from two tenants (or under two `cache_salt`s) gives two entries.
The empty namespace (one tenant, no salt) and the exact codec (`none`) key exactly as entries
without them always did; an encoded entry (`int8`, `int4`) is never served for an exact one.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from cachesmith.errors import InputError

_KEY = re.compile(r"^[0-9a-f]{64}$")


_NAMESPACE = re.compile(r"^[0-9a-f]{32}$")
MAX_CACHE_SALT = 256  # characters of a request's cache_salt


def chunk_key(model_fingerprint: str, dtype: str, token_ids: Sequence[int], namespace: str = "",
              codec: str = "none") -> str:
    digest = hashlib.sha256(f"cachesmith-kv/1\0{model_fingerprint}\0{dtype}\0".encode())
    if namespace:  # after the fixed head: an empty namespace leaves every existing key as it was
        digest.update(f"ns\0{namespace}\0".encode())
    if codec != "none":  # likewise: exact entries keep their keys
        digest.update(f"codec\0{codec}\0".encode())
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def namespace_of(tenant: str = "", cache_salt: str = "") -> str:
    """The namespace of a tenant's entries under a request's `cache_salt`: "" for the one tenant of
    a server without named tenants and no salt; else 32 hex digits of a hash of both, so a header
    names neither the tenant nor the salt."""
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT:
        raise InputError(f"cache_salt: must be a string of at most {MAX_CACHE_SALT} characters")
    if not tenant and not cache_salt:
        return ""
    try:
        raw = f"cachesmith-ns/1\0{tenant}\0{cache_salt}".encode()
    except UnicodeEncodeError:
        raise InputError("cache_salt: holds a character that cannot be encoded (a lone surrogate)") from None
    return hashlib.sha256(raw).hexdigest()[:32]


def validate_namespace(namespace: str) -> str:
    if namespace and not _NAMESPACE.match(namespace):
        raise ValueError(f"namespace={namespace[:40]!r} is not a namespace (empty or 32 lower-case hex digits)")
    return namespace


def is_key(key) -> bool:
    return isinstance(key, str) and _KEY.match(key) is not None


def validate_key(key: str, field: str = "key") -> str:
    if not is_key(key):
        raise InputError(f"{field}={str(key)[:80]!r} is not a chunk key (64 lower-case hex digits)")
    return key


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
