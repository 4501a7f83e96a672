"""Encoded entries (`int8`, `int4`): round trips within the stated bound, partial reads, checksums
over the encoded bytes, keys that name the codec, version-1 entries, and full coverage still
equal to full prefill."""
from __future__ import annotations

import struct

import pytest
import torch

from cachesmith.errors import ConfigError
from cachesmith.kvstore import ChunkStore, StoreConfig, codec
from cachesmith.kvstore.entry_format import BLOCK_ROWS, CorruptEntry, serialize
from cachesmith.kvstore.keys import chunk_key, dtype_name
from cachesmith.kvstore.reader import EntryReader, read_bytes
from cachesmith.kvstore.tiers import BytesSource, MemoryTier
from cachesmith.model import prefill_chunk
from cachesmith.recompute import BatchRunner, RecomputeRequest, preset

CODED = ("int8", "int4")


def _chunk(model, n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    return prefill_chunk(model, torch.randint(3, 120, (n,), generator=g).tolist())


def _entry(model, chunk, name):
    key = chunk_key(model.fingerprint, dtype_name(model.dtype), chunk.token_ids, "", name)
    return key, serialize(key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values, "", name)


@pytest.mark.parametrize("name", CODED)
@pytest.mark.parametrize("num_rows", [1, 64, 100, 130])
def test_blocks_round_trip_within_half_a_scale(name, num_rows):
    g = torch.Generator().manual_seed(num_rows)
    # channels of very different magnitudes, and an outlier row: what per-channel keys are for
    x = torch.randn(num_rows, 3, 64, generator=g) * torch.logspace(-2, 1, 64)
    x[0] *= 20
    for is_value in (False, True):
        blocks = codec.encode(name, x, is_value)
        assert len(blocks) == -(-num_rows // BLOCK_ROWS)
        assert [len(b) for b in blocks[:-1]] == [codec.block_bytes(name, BLOCK_ROWS, 3, 64, is_value, 4)] * (len(blocks) - 1)
        raw = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8)
        out = torch.empty_like(x)
        codec.decode_into(name, raw, 0, num_rows, out, is_value)
        bound = codec.max_error(name, x, is_value)
        assert ((out - x).abs() <= bound * (1 + 1e-6)).all()
        assert (bound > 0).all() and (out - x).abs().max() > 0  # lossy, and the bound is not vacuous
        half = torch.empty(x.shape, dtype=torch.bfloat16)  # a bfloat16 model's buffer: one rounding more
        codec.decode_into(name, raw, 0, num_rows, half, is_value)
        assert ((half.float() - out).abs() <= out.abs() * 2 ** -8).all()


@pytest.mark.parametrize("name", CODED)
def test_the_native_kernel_decodes_bit_for_bit_as_torch_does(name, monkeypatch):
    """Where the native kernels are built, one call decodes a run of blocks; torch's ops serve
    elsewhere (or for other buffers). Both round where the other does, into float32 and bfloat16."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(150, 3, 64, generator=g) * torch.logspace(-2, 1, 64)
    for is_value in (False, True):
        raw = torch.frombuffer(bytearray(b"".join(codec.encode(name, x, is_value))), dtype=torch.uint8)
        for dtype in (torch.float32, torch.bfloat16):
            native = torch.empty(x.shape, dtype=dtype)
            is_native = codec._native_decode(name, raw, native, is_value)
            assert is_native == (codec.library() is not None)
            codec.decode_into(name, raw, 0, 150, native, is_value)
            with monkeypatch.context() as m:
                m.setattr(codec, "library", lambda: None)
                plain = torch.empty(x.shape, dtype=dtype)
                assert not codec._native_decode(name, raw, plain, is_value)
                codec.decode_into(name, raw, 0, 150, plain, is_value)
            assert torch.equal(native, plain)
    assert not codec._native_decode(name, raw, torch.empty(x.shape, dtype=torch.float16), True)  # no kernel


def test_keys_are_quantized_per_channel_and_values_per_token():
    """A channel 100x larger than the rest keeps the others' precision in keys (their own scale);
    a row 100x larger keeps the others' in values."""
    x = torch.randn(64, 1, 64, generator=torch.Generator().manual_seed(1))
    loud_channel = x.clone()
    loud_channel[:, :, 5] *= 100
    loud_row = x.clone()
    loud_row[7] *= 100
    quiet = [c for c in range(64) if c != 5]
    assert codec.max_error("int8", loud_channel, False)[:, :, quiet].max() < codec.max_error("int8", x, False).max() * 1.01
    rows = [r for r in range(64) if r != 7]
    assert codec.max_error("int8", loud_row, True)[rows].max() < codec.max_error("int8", x, True).max() * 1.01


@pytest.mark.parametrize("name", CODED)
def test_an_encoded_entry_reads_whole_and_by_rows_the_same(model, name):
    chunk = _chunk(model)
    _, data = _entry(model, chunk, name)
    reader = EntryReader(BytesSource(data))
    assert reader.header.codec == name and struct.unpack_from("<I", data, 4)[0] == 2
    whole = reader.read_chunk()
    for stored, back in ((chunk.keys.cpu(), whole.keys.cpu()), (chunk.values.cpu(), whole.values.cpu())):
        assert back.dtype == stored.dtype and not torch.equal(back, stored)
        assert (back - stored).abs().max() <= stored.abs().max() / (20 if name == "int8" else 3)
    rows = torch.tensor([5, 130])  # blocks 0 and 2 of three
    k = torch.zeros(chunk.keys[1].shape, dtype=chunk.dtype)
    v = torch.zeros_like(k)
    nbytes = reader.read_layer_into(1, k, v, rows)
    assert torch.equal(k[:64], whole.keys[1][:64].cpu()) and torch.equal(v[128:], whole.values[1][128:].cpu())
    assert k[64:128].abs().sum() == 0  # block 1 was not read
    h = reader.header
    assert nbytes == h.block_bytes(False) + h.block_bytes(False, 22) + h.block_bytes(True) + h.block_bytes(True, 22)


def test_stored_bytes_per_token_of_each_codec(model):
    chunk = _chunk(model, n=256)
    headers = {name: EntryReader(BytesSource(_entry(model, chunk, name)[1])).header for name in codec.CODECS}
    data = {name: h.total_bytes - h.data_offset for name, h in headers.items()}  # the KV, not the header
    assert data["none"] == 2 * model.num_layers * 256 * headers["none"].row_bytes
    assert data["int8"] / data["none"] < 0.27 and data["int4"] / data["none"] < 0.16


def test_a_corrupt_scale_is_caught_by_the_checksum(model):
    chunk = _chunk(model)
    _, data = _entry(model, chunk, "int8")
    h = EntryReader(BytesSource(data)).header
    hkv, d = h.num_kv_heads, h.head_dim
    scale_at = h.block_offset(2, True, 1) + BLOCK_ROWS * hkv * d  # block 1's first value scale
    bad = bytearray(data)
    bad[scale_at + 1] ^= 0x10
    reader = EntryReader(BytesSource(bytes(bad)))
    k = torch.empty(chunk.keys[0].shape, dtype=chunk.dtype)
    v = torch.empty_like(k)
    reader.read_layer_into(2, k, v, torch.tensor([3]))  # another block: read and verified
    with pytest.raises(CorruptEntry, match="layer 2 block 1"):
        reader.read_layer_into(2, k, v, torch.tensor([BLOCK_ROWS + 3]))


def test_an_encoded_entry_under_an_exact_key_is_refused(model):
    chunk = _chunk(model)
    exact = ChunkStore(StoreConfig(tiers=("memory",)), tiers=[MemoryTier(1 << 26)])
    coded = ChunkStore(StoreConfig(tiers=("memory",), codec="int8"), tiers=[MemoryTier(1 << 26)])
    exact_key, coded_key = exact.put(chunk), coded.put(chunk)
    assert exact_key != coded_key and exact_key == exact.key_for(model, chunk.token_ids)
    assert coded_key == coded.key_for(model, chunk.token_ids) and not coded.contains(exact_key)
    # the int8 bytes planted under the exact key: never served, evicted as corrupt
    source = coded.tiers[0].source(coded_key)
    exact.tiers[0].put(exact_key, read_bytes(source, 0, source.size))
    assert exact.get(exact_key, model) is None and not exact.contains(exact_key)
    assert exact.stats.evicted_corrupt == 1
    with pytest.raises(ConfigError, match="codec='fp8'"):
        StoreConfig(codec="fp8")
    with pytest.raises(ValueError, match="codec='int2'"):
        serialize(exact_key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values, "", "int2")


def test_version_one_entries_read_as_they_always_did(model):
    chunk = _chunk(model)
    key = chunk_key(model.fingerprint, dtype_name(model.dtype), chunk.token_ids)
    data = serialize(key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values)
    assert struct.unpack_from("<I", data, 4)[0] == 1 and b'"codec"' not in data  # none: the v1 bytes
    back = EntryReader(BytesSource(data)).read_chunk()
    assert torch.equal(back.keys, chunk.keys.cpu()) and torch.equal(back.values, chunk.values.cpu())
    with pytest.raises(CorruptEntry, match="format version 3"):
        EntryReader(BytesSource(data[:4] + struct.pack("<I", 3) + data[8:]))


@pytest.mark.parametrize("name", CODED)
def test_full_coverage_over_encoded_chunks_equals_full_prefill(tiny_llama_dir, name):
    """Every context row recomputed: the encoded KV is never read into an answer, so the logits are
    full prefill's; at 0% the decoded KV is what answers, and it differs from the exact entry's."""
    from cachesmith.model import Decoder

    model = Decoder(tiny_llama_dir[0], "cpu", torch.float32)
    g = torch.Generator().manual_seed(3)
    chunks_ids = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (70, 40)]
    suffix = torch.randint(3, 120, (6,), generator=g).tolist()
    store = ChunkStore(StoreConfig(tiers=("memory",), codec=name), tiers=[MemoryTier(1 << 26)])
    exact = [prefill_chunk(model, ids) for ids in chunks_ids]
    decoded = [store.get(store.put(c), model) for c in exact]
    ref, _ = model.prefill([t for ids in chunks_ids for t in ids] + suffix)
    runner = BatchRunner(model)
    for preset_name in ("cacheblend", "epic"):
        out = runner.run([RecomputeRequest(decoded, suffix)], preset(preset_name, 1.0, model.num_layers))[0]
        assert (out.logits - ref).abs().max().item() < 1e-4
    reuse = [runner.run([RecomputeRequest(c, suffix)], preset("full_reuse", 0.0, model.num_layers))[0].logits
             for c in (decoded, exact)]
    assert (reuse[0] - reuse[1]).abs().max().item() > 0
