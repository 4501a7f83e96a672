"""The serialized chunk KV entry, identical in every tier (memory bytes, disk file, redis string).

  b"CSKV" | version u32 | header_len u32 | header_crc32 u32 | header JSON | zero pad to 64
  data: for each layer, K then V, each as consecutive blocks of `BLOCK_ROWS` token rows.

Version 1 (the `none` codec) stores K [T, Hkv, D] and V row-major in the entry's dtype, as
computed. Version 2 adds the header's `codec` (`kvstore.codec`: `int8`, `int4`): each block is its
quantized rows then its scales, and decodes on its own; version 1 entries read as they always did.
One layer, or any subset of its blocks, is a known byte range, so a reader fetches only what a
layer needs. Checksums cover each block of each layer's K and V as stored (encoded bytes, scales
included), so a partial read still verifies everything it returns. Blocks use xxh3-64 (about 5x
faster than crc32 here, so verification does not halve the read rate); the header uses crc32.
The header names the entry's namespace (a tenant's, hashed) when it has one.
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
from cachesmith.kvstore import codec as kv_codec
from cachesmith.kvstore.keys import dtype_name

MAGIC = b"CSKV"
VERSION = 2  # written for an encoded entry; an exact (`none`) one is written as version 1
VERSIONS_READ = (1, 2)
BLOCK_ROWS = kv_codec.BLOCK_ROWS
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
    codec: str = "none"  # how the blocks are stored (`kvstore.codec`)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one decoded row [Hkv, D] in the entry's dtype (stored as such by `none`)."""
        return self.num_kv_heads * self.head_dim * ELEMENT_BYTES[self.dtype]

    def block_bytes(self, is_value: bool, num_rows: int = BLOCK_ROWS) -> int:
        """Stored bytes of a block of `num_rows` rows of K or V."""
        if num_rows == BLOCK_ROWS:
            return self._sizes[is_value][0]
        return kv_codec.block_bytes(self.codec, num_rows, self.num_kv_heads, self.head_dim, is_value,
                                    ELEMENT_BYTES[self.dtype])

    @functools.cached_property
    def _sizes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per K and V: (stored bytes of a full block, of one layer's tensor). Computed once per
        header: every layer read of every entry addresses its blocks by them (headers are cached)."""
        num_full, rest = divmod(self.num_tokens, BLOCK_ROWS)
        sizes = []
        for is_value in (False, True):
            full = kv_codec.block_bytes(self.codec, BLOCK_ROWS, self.num_kv_heads, self.head_dim, is_value,
                                        ELEMENT_BYTES[self.dtype])
            last = kv_codec.block_bytes(self.codec, rest, self.num_kv_heads, self.head_dim, is_value,
                                        ELEMENT_BYTES[self.dtype]) if rest else 0
            sizes.append((full, num_full * full + last))
        return sizes[0], sizes[1]

    def stored_bytes(self, is_value: bool) -> int:
        """Stored bytes of one layer's K or V."""
        return self._sizes[is_value][1]

    def rows_bytes(self, num_rows: int) -> int:
        """Stored bytes of `num_rows` rows of one layer's K and V (encoded blocks: on average)."""
        return num_rows * (self._sizes[0][1] + self._sizes[1][1]) // max(1, self.num_tokens)

    def block_offset(self, layer: int, is_value: bool, block: int = 0) -> int:
        """Where block `block` of a layer's K or V starts (block num_blocks: where it ends)."""
        (k_full, k_bytes), (v_full, v_bytes) = self._sizes
        start = self.data_offset + layer * (k_bytes + v_bytes) + is_value * k_bytes
        return start + min(block * (v_full if is_value else k_full), v_bytes if is_value else k_bytes)

    def offset(self, layer: int, is_value: bool, row: int = 0) -> int:
        """Where a row of a version-1 entry starts (an encoded entry is addressed by blocks)."""
        return self.block_offset(layer, is_value) + row * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.block_offset(self.num_layers, False)


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


def _encoded_layer(codec: str, k: torch.Tensor, v: torch.Tensor, row_bytes: int) -> tuple[list[bytes], list]:
    """One layer's K and V [T, Hkv, D] -> their stored bytes and per-block checksums."""
    if codec == "none":
        kb, vb = _as_bytes(k), _as_bytes(v)
        return [kb, vb], [_block_crcs(kb, row_bytes), _block_crcs(vb, row_bytes)]
    blocks = [kv_codec.encode(codec, k, False), kv_codec.encode(codec, v, True)]
    return [b"".join(b) for b in blocks], [tuple(block_checksum(x) for x in b) for b in blocks]


def serialize(key: str, model_fingerprint: str, token_ids, keys: torch.Tensor, values: torch.Tensor,
              namespace: str = "", codec: str = "none") -> bytes:
    """keys/values [num_layers, num_tokens, num_kv_heads, head_dim] -> entry bytes, its blocks
    stored by `codec`."""
    if codec not in kv_codec.CODECS:
        raise ValueError(f"codec={codec!r}: must be one of {', '.join(kv_codec.CODECS)}")
    num_layers, num_tokens, num_kv_heads, head_dim = keys.shape
    # a device chunk comes to the host in one copy per tensor, not one synchronizing copy per layer
    keys, values = keys.to("cpu"), values.to("cpu")
    row_bytes = num_kv_heads * head_dim * keys.element_size()
    blobs, checksums = [], []
    for layer in range(num_layers):
        data, sums = _encoded_layer(codec, keys[layer], values[layer], row_bytes)
        blobs += data
        checksums.append(sums)
    fields = {
        "key": key, "model_fingerprint": model_fingerprint, "dtype": dtype_name(keys.dtype),
        "num_layers": num_layers, "num_tokens": num_tokens, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "token_ids": list(token_ids), "checksums": checksums,
    }
    if namespace:  # absent for the empty namespace: such entries read as they always did
        fields["namespace"] = namespace
    if codec != "none":
        fields["codec"] = codec
    header = json.dumps(fields).encode()
    fixed = _FIXED.pack(MAGIC, 1 if codec == "none" else VERSION, len(header), zlib.crc32(header))
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
    if version not in VERSIONS_READ:
        raise CorruptEntry(f"format version {version}, this build reads {', '.join(map(str, VERSIONS_READ))}")
    raw = read(_FIXED.size, header_len)
    if len(raw) != header_len or zlib.crc32(raw) != header_crc:
        raise CorruptEntry("header checksum mismatch")
    header = _decode_header(raw)
    if (version == 1) != (header.codec == "none"):
        raise CorruptEntry(f"format version {version} with codec {header.codec!r}")
    return header


@functools.lru_cache(maxsize=4096)
def _decode_header(raw: bytes) -> EntryHeader:
    """The verified JSON header -> `EntryHeader`, cached by its bytes: a batch opens every chunk it
    reads, and parsing the token ids and checksums cost ~0.2 ms an entry."""
    header_len = len(raw)
    h = json.loads(raw)
    if h["dtype"] not in DTYPES:
        raise CorruptEntry(f"unknown dtype {h['dtype']!r}")
    if h.get("codec", "none") not in kv_codec.CODECS:
        raise CorruptEntry(f"unknown codec {h['codec']!r}")
    data_offset = _FIXED.size + header_len + (-(_FIXED.size + header_len)) % _ALIGN
    checksums = tuple((tuple(k), tuple(v)) for k, v in h["checksums"])
    return EntryHeader(h["key"], h["model_fingerprint"], h["dtype"], h["num_layers"], h["num_tokens"],
                       h["num_kv_heads"], h["head_dim"], tuple(h["token_ids"]), checksums, data_offset,
                       h.get("namespace", ""), h.get("codec", "none"))
