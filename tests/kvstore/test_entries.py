"""Entry format and tiers: round trips, partial reads, checksums, LRU, atomic writes, bad keys."""
from __future__ import annotations

import errno
import threading

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.entry_format import BLOCK_ROWS, CorruptEntry, serialize
from cachesmith.kvstore.keys import chunk_key, dtype_name
from cachesmith.kvstore.reader import EntryReader
from cachesmith.kvstore.disk_tier import DiskTier
from cachesmith.kvstore.tiers import BytesSource, MemoryTier
from cachesmith.model import prefill_chunk


def _chunk(model, n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    return prefill_chunk(model, torch.randint(3, 120, (n,), generator=g).tolist())


def _entry(model, chunk):
    key = chunk_key(model.fingerprint, dtype_name(model.dtype), chunk.token_ids)
    return key, serialize(key, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_and_row_subsets(tiny_llama_dir, dtype):
    from cachesmith.model import Decoder

    model = Decoder(tiny_llama_dir[0], dtype=dtype)
    chunk = _chunk(model)
    key, data = _entry(model, chunk)
    reader = EntryReader(BytesSource(data))
    back = reader.read_chunk()
    assert back.token_ids == chunk.token_ids and torch.equal(back.keys, chunk.keys)
    assert torch.equal(back.values, chunk.values) and back.keys.dtype == chunk.keys.dtype
    rows = torch.tensor([0, 5, 63, 130, 149])  # blocks 0 and 2 of three 64-row blocks
    k = torch.zeros_like(chunk.keys[1])
    v = torch.zeros_like(chunk.values[1])
    nbytes = reader.read_layer_into(1, k, v, rows)
    assert torch.equal(k[rows], chunk.keys[1][rows]) and torch.equal(v[rows], chunk.values[1][rows])
    assert torch.equal(k[128:], chunk.keys[1][128:])  # whole covering blocks, stored values
    assert k[64:128].abs().sum() == 0 and v[64:128].abs().sum() == 0  # block 1 was not read
    assert nbytes == 2 * (64 + 22) * reader.header.row_bytes


def test_flipped_byte_and_truncation_are_detected(model):
    chunk = _chunk(model)
    key, data = _entry(model, chunk)
    reader = EntryReader(BytesSource(data))
    flipped = bytearray(data)
    flipped[reader.header.offset(2, True, 70)] ^= 0x40
    bad = EntryReader(BytesSource(bytes(flipped)))
    k = torch.empty(chunk.keys[0].shape, dtype=chunk.dtype)  # entries are read into host memory
    v = torch.empty(chunk.values[0].shape, dtype=chunk.dtype)
    bad.read_layer_into(2, k, v, torch.tensor([3]))  # the damaged block (rows 64..127) is not read
    with pytest.raises(CorruptEntry, match="layer 2 block 1"):
        bad.read_layer_into(2, k, v, torch.tensor([BLOCK_ROWS + 1]))
    with pytest.raises(CorruptEntry, match="truncated"):
        EntryReader(BytesSource(data[: len(data) - 10]))
    header_hit = bytearray(data)
    header_hit[20] ^= 0x01
    with pytest.raises(CorruptEntry, match="header checksum"):
        EntryReader(BytesSource(bytes(header_hit)))
    with pytest.raises(CorruptEntry, match="magic"):
        EntryReader(BytesSource(b"NOPE" + data[4:]))


def test_memory_tier_is_lru_by_bytes():
    tier = MemoryTier(max_bytes=250)
    for name in "abc":
        assert tier.put(name * 64, bytes(100))
    assert not tier.contains("a" * 64) and tier.contains("c" * 64) and tier.num_bytes == 200
    tier.source("b" * 64)  # touch b: c becomes the oldest
    tier.put("d" * 64, bytes(100))
    assert tier.contains("b" * 64) and not tier.contains("c" * 64)
    assert not tier.put("e" * 64, bytes(300))  # larger than the whole tier


def test_disk_tier_rejects_bad_keys(tmp_path):
    tier = DiskTier(tmp_path)
    for bad in ["../../etc/passwd", "A" * 64, "abc", "g" * 64, "a" * 63 + "/"]:
        with pytest.raises(InputError, match="not a chunk key"):
            tier.source(bad)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_never_leave_a_torn_file(model, tmp_path):
    tier = DiskTier(tmp_path)
    key, data = _entry(model, _chunk(model, 250))
    threads = [threading.Thread(target=tier.put, args=(key, data)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.path(key).read_bytes() == data
    assert [p.name for p in tier.path(key).parent.iterdir()] == [tier.path(key).name]  # no temp files


def test_disk_full_fails_cleanly(model, tmp_path, monkeypatch, caplog):
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path))
    chunk = _chunk(model)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("cachesmith.kvstore.disk_tier.os.fsync", full)
    key = store.put(chunk)
    assert "disk full" in caplog.text
    assert not store.tiers[1].contains(key) and list(tmp_path.glob("*/*")) == []
    assert torch.equal(store.get(key, model).keys, chunk.keys)  # the memory tier still serves it
