"""The serialized chunk KV entry, identical in every tier (memory bytes, disk file, redis string).

  b"CSKV" | version u32 | header_len u32 | header_crc32 u32 | header JSON | zero pad to 64
  data: for each layer, K [T, Hkv, D] then V [T, Hkv, D], row-major, in the entry's dtype.

One layer, or any subset of its token rows, is a known byte range, so a reader fetches only what a
layer needs. Checksums cover blocks of `BLOCK_ROWS` rows of each layer's K and V, so a
partial read still verifies everything it returns. Blocks use xxh3-64 (about 5x faster than crc32
here, so verification does not halve the read rate); the header uses crc32. The header names
the entry's namespace (a tenant's, hashed) when it has one.
"""
from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass

import torch
import xxhash

from cachesmith.errors import CachesmithError
from cachesmith.kvstore.keys import dtype_name

MAGIC = b"CSKV"
VERSION = 1
BLOCK_ROWS = 64
_FIXED = struct.Struct("<4sIII")
_ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CorruptEntry(CachesmithError):
    """An entry failed its magic, version, header or data checksum, or disagrees with its key."""


@dataclass(frozen=True)
class EntryHeader:
    key: str
    model_fingerprint: str
    dtype: str
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    token_ids: tuple[int, ...]
    checksums: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # [layer][K|V][block]
    data_offset: int
    namespace: str = ""  # the tenant (and cache salt) the entry belongs to, hashed: `keys.namespace_of`

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * ELEMENT_BYTES[self.dtype]

    @property
    def tensor_bytes(self) -> int:
        return self.num_tokens * self.row_bytes

    def offset(self, layer: int, is_value: bool, row: int = 0) -> int:
        return self.data_offset + (2 * layer + is_value) * self.tensor_bytes + row * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.offset(self.num_layers, False)


def block_checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _as_bytes(t: torch.Tensor) -> bytes:
    """Bytes of a CPU tensor (bfloat16 through an int16 view)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _block_crcs(raw: bytes, row_bytes: int) -> tuple[int, ...]:
    step = BLOCK_ROWS * row_bytes
    return tuple(block_checksum(raw[i:i + step]) for i in range(0, len(raw), step))


def serialize(key: str, model_fingerprint: str, token_ids, keys: torch.Tensor, values: torch.Tensor,
              namespace: str = "") -> bytes:
    """keys/values [num_layers, num_tokens, num_kv_heads, head_dim] -> entry bytes."""
    num_layers, num_tokens, num_kv_heads, head_dim = keys.shape
    # a device chunk comes to the host in one copy per tensor, not one synchronizing copy per layer
    keys, values = keys.to("cpu"), values.to("cpu")
    row_bytes = num_kv_heads * head_dim * keys.element_size()
    blobs, checksums = [], []
    for layer in range(num_layers):
        k, v = _as_bytes(keys[layer]), _as_bytes(values[layer])
        blobs += [k, v]
        checksums.append([_block_crcs(k, row_bytes), _block_crcs(v, row_bytes)])
    fields = {
        "key": key, "model_fingerprint": model_fingerprint, "dtype": dtype_name(keys.dtype),
        "num_layers": num_layers, "num_tokens": num_tokens, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "token_ids": list(token_ids), "checksums": checksums,
    }
    if namespace:  # absent for the empty namespace: such entries read as they always did
        fields["namespace"] = namespace
    header = json.dumps(fields).encode()
    fixed = _FIXED.pack(MAGIC, VERSION, len(header), zlib.crc32(header))
    pad = (-(len(fixed) + len(header))) % _ALIGN
    return b"".join([fixed, header, b"\0" * pad, *blobs])


def parse_header(read) -> EntryHeader:
    """`read(offset, length) -> bytes` of some byte source -> verified header."""
    fixed = read(0, _FIXED.size)
    if len(fixed) < _FIXED.size:
        raise CorruptEntry("entry shorter than its fixed header")
    magic, version, header_len, header_crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptEntry(f"format version {version}, this build reads {VERSION}")
    raw = read(_FIXED.size, header_len)
    if len(raw) != header_len or zlib.crc32(raw) != header_crc:
        raise CorruptEntry("header checksum mismatch")
    return _decode_header(raw)


@functools.lru_cache(maxsize=4096)
def _decode_header(raw: bytes) -> EntryHeader:
    """The verified JSON header -> `EntryHeader`, cached by its bytes: a batch opens every chunk it
    reads, and parsing the token ids and checksums cost ~0.2 ms an entry."""
    header_len = len(raw)
    h = json.loads(raw)
    if h["dtype"] not in DTYPES:
        raise CorruptEntry(f"unknown dtype {h['dtype']!r}")
    data_offset = _FIXED.size + header_len + (-(_FIXED.size + header_len)) % _ALIGN
    checksums = tuple((tuple(k), tuple(v)) for k, v in h["checksums"])
    return EntryHeader(h["key"], h["model_fingerprint"], h["dtype"], h["num_layers"], h["num_tokens"],
                       h["num_kv_heads"], h["head_dim"], tuple(h["token_ids"]), checksums, data_offset,
                       h.get("namespace", ""))
