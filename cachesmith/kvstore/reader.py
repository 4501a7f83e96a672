"""Reading entries from any byte source: whole entries, one layer, or a subset of a layer's rows.

In: a `RangeSource` (disk file, memory bytes, redis string). Out: verified tensors in the entry's
dtype, written into caller-owned staging buffers: an exact entry's bytes straight in (no
intermediate copy for full-layer reads), an encoded entry's blocks read into a scratch buffer,
verified, and decoded into them in the same pass (`kvstore.codec`).
"""
from __future__ import annotations

from typing import Protocol

import torch

from cachesmith.kvstore import codec as kv_codec
from cachesmith.kvstore.entry_format import BLOCK_ROWS, CorruptEntry, EntryHeader, block_checksum, parse_header
from cachesmith.model import ChunkKV
from cachesmith.model import device as accel


class RangeSource(Protocol):
    size: int

    def readinto(self, offset: int, buffer: memoryview) -> int: ...

    def readinto_many(self, offset: int, buffers: list[memoryview]) -> int: ...

    def close(self) -> None: ...


def read_bytes(source: RangeSource, offset: int, length: int) -> bytes:
    buf = bytearray(max(0, min(length, source.size - offset)))
    n = source.readinto(offset, memoryview(buf)) if buf else 0
    return bytes(buf[:n])


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (bfloat16 through an int16 view)."""
    if t.device.type != "cpu":  # a device cache is filled through host staging (`kvstore.staging`)
        raise TypeError(f"stored KV is read into host memory, not into a {t.device.type} tensor")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block indices -> [first, end) runs of consecutive blocks."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


class EntryReader:
    def __init__(self, source: RangeSource) -> None:
        self.source = source
        self.tier = None  # set by the store: the tier this entry was read from
        self.header: EntryHeader = parse_header(lambda o, n: read_bytes(source, o, n))
        if source.size < self.header.total_bytes:
            raise CorruptEntry(f"entry truncated: {source.size} of {self.header.total_bytes} bytes")

    def close(self) -> None:
        self.source.close()

    def _verify(self, layer: int, is_value: bool, run: tuple[int, int], view: memoryview) -> None:
        crcs = self.header.checksums[layer][is_value]
        step = self.header.block_bytes(is_value)
        for i, block in enumerate(range(*run)):
            if block_checksum(view[i * step:(i + 1) * step]) != crcs[block]:
                raise CorruptEntry(f"checksum mismatch in layer {layer} block {block}")

    def _read_run(self, layer: int, run: tuple[int, int], k_out: torch.Tensor, v_out: torch.Tensor) -> int:
        """K and V rows of blocks [run) into contiguous k_out/v_out; every block verified."""
        h = self.header
        if h.codec != "none":  # the stored blocks, verified, then decoded into the buffers
            raws = self.read_encoded(layer, run)
            for is_value, (raw, out) in enumerate(zip(raws, (k_out, v_out))):
                kv_codec.decode_into(h.codec, raw, run[0], h.num_tokens, out, bool(is_value))
            return sum(raw.numel() for raw in raws)
        return self._read_verified(layer, run, [_byte_view(k_out), _byte_view(v_out)])

    def read_encoded(self, layer: int, run: tuple[int, int], is_pinned: bool = False) -> tuple[torch.Tensor, ...]:
        """The stored bytes of blocks [run) of an encoded entry's layer, K's and V's (uint8, pinned
        where they feed an asynchronous copy), verified: what a device decodes after copying the
        smaller bytes (`kvstore.codec.decode_into`)."""
        h = self.header
        raws = tuple(accel.pinned_empty((h.block_offset(layer, is_v, run[1]) - h.block_offset(layer, is_v, run[0]),),
                                        torch.uint8, is_pinned) for is_v in (False, True))
        self._read_verified(layer, run, [memoryview(t.numpy()) for t in raws])
        return raws

    def _read_verified(self, layer: int, run: tuple[int, int], views: list[memoryview]) -> int:
        """Blocks [run) of a layer's K and V as stored, into `views`, every block verified."""
        h = self.header
        if run == (0, -(-h.num_tokens // BLOCK_ROWS)):  # a whole layer: K then V, one read
            got = self.source.readinto_many(h.block_offset(layer, False), views)
        else:
            got = sum(self.source.readinto(h.block_offset(layer, bool(is_v), run[0]), view)
                      for is_v, view in enumerate(views))
        want = sum(len(view) for view in views)
        if got != want:
            raise CorruptEntry(f"short read in layer {layer}: {got} of {want} bytes")
        for is_value, view in enumerate(views):
            self._verify(layer, bool(is_value), run, view)
        return got

    def read_layer_into(self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor,
                        rows: torch.Tensor | None = None) -> int:
        """Fill k_out/v_out [T, Hkv, D] of `layer`, or with `rows` only the 64-row blocks holding
        them (their other rows get their stored values too: harmless, and no scatter copy).
        Returns bytes read."""
        if rows is None:
            return self.read_blocks_into(layer, k_out, v_out, None)
        return self.read_blocks_into(layer, k_out, v_out, sorted(set((rows // BLOCK_ROWS).tolist())))

    def read_blocks_into(self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor,
                         blocks: list[int] | None) -> int:
        """Fill the rows of the given sorted 64-row blocks (None: all) of k_out/v_out [T, Hkv, D]."""
        h = self.header
        num_blocks = -(-h.num_tokens // BLOCK_ROWS)
        if blocks is None or len(blocks) == num_blocks:
            return self._read_run(layer, (0, num_blocks), k_out, v_out)
        nbytes = 0
        for run in block_runs(blocks):
            first, end = run[0] * BLOCK_ROWS, min(run[1] * BLOCK_ROWS, h.num_tokens)
            nbytes += self._read_run(layer, run, k_out[first:end], v_out[first:end])
        return nbytes

    def read_chunk(self, device: torch.device | str = "cpu") -> ChunkKV:
        """The whole entry, verified in host memory, then moved to `device` (one copy per tensor)."""
        h = self.header
        shape = (h.num_layers, h.num_tokens, h.num_kv_heads, h.head_dim)
        is_pinned = torch.device(device).type == "cuda"
        keys = accel.pinned_empty(shape, h.torch_dtype, is_pinned)  # [L, T, Hkv, D]
        values = accel.pinned_empty(shape, h.torch_dtype, is_pinned)
        for layer in range(h.num_layers):
            self.read_layer_into(layer, keys[layer], values[layer])
        return ChunkKV(h.token_ids, keys.to(device), values.to(device), h.model_fingerprint)
