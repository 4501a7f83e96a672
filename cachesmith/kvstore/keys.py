"""Content addresses of chunk KV entries: sha256 over (model fingerprint, dtype, token ids).

A stored cache is never served for another model, dtype or token sequence because all three are
in the key, and the entry's header repeats them for verification on read.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from cachesmith.errors import InputError

_KEY = re.compile(r"^[0-9a-f]{64}$")


def chunk_key(model_fingerprint: str, dtype: str, token_ids: Sequence[int]) -> str:
    digest = hashlib.sha256(f"cachesmith-kv/1\0{model_fingerprint}\0{dtype}\0".encode())
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def validate_key(key: str, field: str = "key") -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise InputError(f"{field}={str(key)[:80]!r} is not a chunk key (64 lower-case hex digits)")
    return key


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
