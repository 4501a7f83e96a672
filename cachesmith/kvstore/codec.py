"""Stored KV at fewer bytes: the codecs of a chunk entry's data blocks.

In: one layer's K or V rows [num_rows, num_kv_heads, head_dim] in the model's dtype. Out: the
encoded bytes of each block of `BLOCK_ROWS` rows (`encode`), and back, dequantized into a
caller's buffer in the model's dtype (`decode_into`: on the host by the native kernel where it is
built, else, and on a device, by torch's ops).

A block is self-contained: its quantized values, then its scales, so a partial read by rows
decodes the blocks it fetched and the entry's checksums cover the encoded bytes. Scales are
float16, rounded up so that no value overflows its range: each element decodes within half its
scale of what was stored (`max_error`). The layouts follow KIVI: keys are quantized per channel
over a block's rows (a key's outlier channels keep their own scale), values per token (each
head's row, or each `INT4_GROUP` of it, one scale). Symmetric, no zero point.

- `none`: the model's dtype as computed (the entry's version-1 layout; read without a copy).
- `int8`: one byte per element.
- `int4`: two elements per byte (an element is `q + 8` in a nibble, the even one low).
The layout belongs to the codec's name, and the name is in the chunk key: an entry is never
decoded by another layout, nor served where an exact one was asked for.
"""
from __future__ import annotations

import torch

from cachesmith.model.native_build import library

CODECS = ("none", "int8", "int4")
BLOCK_ROWS = 64  # rows of one checksummed block (the entry format's)
INT4_GROUP = 32  # elements of a value row under one int4 scale
_QMAX = {"int8": 127, "int4": 7}
_BITS = {"int8": 8, "int4": 4}
_SCALE_BYTES = 2  # float16


def _value_groups(codec: str, head_dim: int) -> int:
    """Scales per (token, head) of a value row."""
    return head_dim // INT4_GROUP if codec == "int4" and head_dim % INT4_GROUP == 0 else 1


def _q_bytes(codec: str, num_rows: int, num_kv_heads: int, head_dim: int) -> int:
    n = num_rows * num_kv_heads * head_dim
    return n if codec == "int8" else (n + 1) // 2


def _scale_shape(codec: str, num_rows: int, num_kv_heads: int, head_dim: int, is_value: bool) -> tuple[int, ...]:
    if is_value:
        return (num_rows, num_kv_heads, _value_groups(codec, head_dim))
    return (num_kv_heads, head_dim)


def block_bytes(codec: str, num_rows: int, num_kv_heads: int, head_dim: int, is_value: bool,
                element_bytes: int) -> int:
    """Encoded bytes of one block of `num_rows` rows."""
    if codec == "none":
        return num_rows * num_kv_heads * head_dim * element_bytes
    scales = 1
    for n in _scale_shape(codec, num_rows, num_kv_heads, head_dim, is_value):
        scales *= n
    return _q_bytes(codec, num_rows, num_kv_heads, head_dim) + scales * _SCALE_BYTES


def _scales(codec: str, x: torch.Tensor, is_value: bool) -> torch.Tensor:
    """float16 scales of blocks x [num_blocks, rows, Hkv, D] (float32), rounded up: |x| / scale
    stays within the codec's range."""
    nb, rows, hkv, d = x.shape
    if is_value:
        groups = _value_groups(codec, d)
        amax = x.abs().reshape(nb, rows, hkv, groups, d // groups).amax(dim=-1)  # [nb, rows, Hkv, G]
    else:
        amax = x.abs().amax(dim=1)  # [nb, Hkv, D]: per channel over the block's rows
    scale = (amax / _QMAX[codec]).clamp(min=2.0 ** -24)
    half = scale.to(torch.float16)
    # a scale rounded down would push the largest value past the range: step it up one ulp
    return torch.where(half.float() < scale, torch.nextafter(half, torch.tensor(torch.inf, dtype=torch.float16)),
                       half)


def _expand(scale: torch.Tensor, shape: tuple[int, ...], is_value: bool) -> torch.Tensor:
    """Scales broadcast to blocks of `shape` [nb, rows, Hkv, D]."""
    nb, rows, hkv, d = shape
    if is_value:
        groups = scale.shape[-1]
        return scale.float().repeat_interleave(d // groups, dim=-1)
    return scale.float()[:, None]


def _pack(q: torch.Tensor, codec: str) -> torch.Tensor:
    """int8 levels [nb, n] -> bytes [nb, n] (int8) or [nb, n/2] (int4: two per byte)."""
    if codec == "int8":
        return q.view(torch.uint8)
    u = (q + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _encode_blocks(codec: str, x: torch.Tensor, is_value: bool) -> torch.Tensor:
    """Blocks x [nb, rows, Hkv, D] -> their encoded bytes [nb, block_bytes] (uint8)."""
    x = x.float()
    scale = _scales(codec, x, is_value)
    qmax = _QMAX[codec]
    q = torch.round(x / _expand(scale, x.shape, is_value)).clamp(-qmax, qmax).to(torch.int8)
    packed = _pack(q.reshape(x.shape[0], -1), codec)
    return torch.cat([packed, scale.reshape(x.shape[0], -1).view(torch.uint8)], dim=1)


def encode(codec: str, x: torch.Tensor, is_value: bool) -> list[bytes]:
    """One layer's K (`is_value` False) or V rows x [T, Hkv, D] (CPU) -> each block's bytes."""
    num_rows = x.shape[0]
    num_full = num_rows // BLOCK_ROWS
    out = []
    if num_full:
        full = x[:num_full * BLOCK_ROWS].reshape(num_full, BLOCK_ROWS, *x.shape[1:])
        out += [bytes(b.numpy()) for b in _encode_blocks(codec, full, is_value)]
    if num_rows % BLOCK_ROWS:
        out.append(bytes(_encode_blocks(codec, x[num_full * BLOCK_ROWS:][None], is_value)[0].numpy()))
    return out


def _native_decode(codec: str, raw: torch.Tensor, out: torch.Tensor, is_value: bool) -> bool:
    """`decode_into` in one call of the native kernel where it is built (one pass, one thread, no
    temporaries: through torch's ops a decode costs about 20 us even for one block); False where it
    is not, or cannot take these buffers."""
    lib = library()
    if lib is None or out.dtype not in (torch.float32, torch.bfloat16) or not raw.is_contiguous() \
            or not out.is_contiguous() or raw.device.type != "cpu" or out.device.type != "cpu":
        return False
    num_rows, hkv, d = out.shape
    group = d // _value_groups(codec, d) if is_value else 0  # levels a scale covers (0: per channel)
    full_bytes = block_bytes(codec, BLOCK_ROWS, hkv, d, is_value, 0)
    return lib.cs_kv_dequant(raw.data_ptr(), num_rows, BLOCK_ROWS, full_bytes, hkv * d, group, _BITS[codec],
                             out.data_ptr(), int(out.dtype == torch.bfloat16)) == 0


def _decode_blocks(codec: str, raw: torch.Tensor, rows: int, out: torch.Tensor, is_value: bool) -> None:
    """Encoded blocks raw [nb, block_bytes] (uint8) of `rows` rows each -> out [nb, rows, Hkv, D]:
    the levels converted in place into `out`, then scaled there (a mixed int8 x float multiply
    broadcasting the scales runs at a third of the speed of the two passes)."""
    nb, _, hkv, d = out.shape
    q_bytes = _q_bytes(codec, rows, hkv, d)
    shape = _scale_shape(codec, rows, hkv, d, is_value)
    # float16 scales read in place (each block's start is even): float32 x float16 stays float32
    scale = raw[:, q_bytes:].view(torch.float16).view(nb, *shape)
    if codec == "int8":
        out.view(nb, -1).copy_(raw[:, :q_bytes].view(torch.int8))
    else:  # two levels a byte, the even one low, each stored as q + 8
        pairs = out.view(nb, -1, 2)  # [nb, n / 2, 2]: head_dim is even
        packed = raw[:, :q_bytes]
        pairs[..., 0].copy_(packed & 0xF)
        pairs[..., 1].copy_(packed >> 4)
        out.sub_(8)
    if is_value:  # [nb, rows, Hkv, G, D/G] times one scale per group: broadcast, nothing repeated
        out.view(nb, rows, hkv, shape[-1], -1).mul_(scale[..., None])
    else:  # per channel: one scale per (head, dim) over the block's rows
        out.mul_(scale[:, None])


def decode_into(codec: str, raw: torch.Tensor, first_block: int, num_tokens: int, out: torch.Tensor,
                is_value: bool) -> None:
    """The encoded bytes `raw` (uint8) of consecutive blocks from `first_block` of a tensor of
    `num_tokens` rows -> out [rows of those blocks, Hkv, D], in out's dtype."""
    num_rows, hkv, d = out.shape
    num_full, rest = divmod(num_rows, BLOCK_ROWS)
    if rest and first_block * BLOCK_ROWS + num_rows != num_tokens:
        raise ValueError("only a tensor's last block holds fewer than BLOCK_ROWS rows")
    if _native_decode(codec, raw, out, is_value):
        return
    full_bytes = block_bytes(codec, BLOCK_ROWS, hkv, d, is_value, 0)
    if num_full:
        blocks = out[:num_full * BLOCK_ROWS].view(num_full, BLOCK_ROWS, hkv, d)
        _decode_blocks(codec, raw[:num_full * full_bytes].view(num_full, full_bytes), BLOCK_ROWS, blocks, is_value)
    if rest:
        _decode_blocks(codec, raw[num_full * full_bytes:].view(1, -1), rest, out[num_full * BLOCK_ROWS:][None],
                       is_value)


def max_error(codec: str, x: torch.Tensor, is_value: bool) -> torch.Tensor:
    """The bound each element of x [T, Hkv, D] decodes within: half its stored scale."""
    bounds = []
    for start in range(0, x.shape[0], BLOCK_ROWS):
        block = x[start:start + BLOCK_ROWS][None].float()  # [1, rows, Hkv, D]
        scale = _expand(_scales(codec, block, is_value), block.shape, is_value)
        bounds.append((scale / 2).expand(block.shape)[0])
    return torch.cat(bounds)
