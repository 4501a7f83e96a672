"""The staged route from the store to a cache: host buffers, verified, then copied into the
destination (on CUDA through a side stream). On CPU it is asked for explicitly, so CPU CI walks the
same code a GPU runs; on a CUDA machine every test also runs there (`make test-cuda`)."""
from __future__ import annotations

import pytest
import torch

from cachesmith.kvstore import ChunkStore, StoreConfig, TransferConfig, TransferEngine
from cachesmith.kvstore.entry_format import BLOCK_ROWS, CorruptEntry
from cachesmith.kvstore.staging import StagingPath
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.recompute import BatchRunner, RecomputeConfig, Signal
from tests.kvstore.helpers import stored_requests

def _stored_chunk(model, store, num_tokens=150):
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(7))
    chunk = prefill_chunk(model, ids.tolist())
    return chunk, store.put(chunk)


@pytest.mark.parametrize("blocks", [None, [0, 2]], ids=["all", "blocks-0-2"])
def test_staged_read_equals_the_direct_read(loaded_models, device, tmp_path, blocks):
    model = loaded_models(device)
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk, key = _stored_chunk(model, store)
    layer, shape = 1, chunk.keys.shape[1:]  # [T, Hkv, D]
    direct_k, direct_v = torch.zeros(shape, dtype=chunk.dtype), torch.zeros(shape, dtype=chunk.dtype)
    with _opened(store, key, model) as reader:
        reader.read_blocks_into(layer, direct_k, direct_v, blocks)
    sentinel = -7.0  # rows outside the blocks read must be left as they were
    k_dst = torch.full(shape, sentinel, dtype=chunk.dtype, device=model.device)
    v_dst = torch.full(shape, sentinel, dtype=chunk.dtype, device=model.device)
    copies = StagingPath(model.device, is_staged=True).batch()
    with _opened(store, key, model) as reader:
        nbytes = copies.load(reader, layer, k_dst, v_dst, blocks)
    copies.wait_layer(layer)
    read = torch.zeros(shape[0], dtype=torch.bool)
    for b in blocks if blocks is not None else range(-(-shape[0] // BLOCK_ROWS)):
        read[b * BLOCK_ROWS:(b + 1) * BLOCK_ROWS] = True
    assert nbytes == 2 * int(read.sum()) * chunk.keys[0, 0].numel() * chunk.keys.element_size()
    assert torch.equal(k_dst.cpu()[read], direct_k[read]) and torch.equal(v_dst.cpu()[read], direct_v[read])
    assert torch.equal(k_dst.cpu()[read], chunk.keys[layer].cpu()[read])
    assert bool((k_dst.cpu()[~read] == sentinel).all()) and bool((v_dst.cpu()[~read] == sentinel).all())


class _opened:
    def __init__(self, store, key, model):
        self.reader = store.open(key, model)

    def __enter__(self):
        return self.reader

    def __exit__(self, *exc):
        self.reader.close()


def test_a_corrupt_block_never_reaches_the_destination(loaded_models, device, tmp_path):
    model = loaded_models(device)
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path))
    chunk, key = _stored_chunk(model, store)
    path = store.tiers[0].path(key)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # the last layer's V, last block
    path.write_bytes(bytes(data))
    shape = chunk.keys.shape[1:]
    k_dst = torch.zeros(shape, dtype=chunk.dtype, device=model.device)
    v_dst = torch.zeros(shape, dtype=chunk.dtype, device=model.device)
    copies = StagingPath(model.device, is_staged=True).batch()
    with _opened(store, key, model) as reader, pytest.raises(CorruptEntry, match="checksum"):
        copies.load(reader, model.num_layers - 1, k_dst, v_dst, None)
    copies.wait_all()
    assert not bool(k_dst.any()) and not bool(v_dst.any())  # verified on the host, nothing copied


@pytest.mark.parametrize("is_staged", [False, True], ids=["direct", "staged"])
def test_staged_route_never_takes_a_host_view_of_the_cache(tiny_llama_dir, tmp_path, monkeypatch, is_staged):
    """What a GPU run needs: a host view (`.numpy()`) of a device cache does not exist. The staged
    route must take none of the cache; the direct route, which reads into the cache on purpose, is
    seen by the same spy, so the spy can fail. (Loads run on loader threads: the spy wraps the
    reader's one place that views bytes, which every thread goes through.)"""
    import cachesmith.kvstore.reader as reader_module

    model = Decoder(tiny_llama_dir[0])
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    _, keyed = stored_requests(model, store, seeds=(3,))
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
    engine = TransferEngine(store, model, TransferConfig(is_staged=is_staged))
    viewed: list[int] = []
    byte_view = reader_module._byte_view

    def spy(t):
        viewed.append(t.untyped_storage().data_ptr())
        return byte_view(t)

    monkeypatch.setattr(reader_module, "_byte_view", spy)
    with engine.stage(keyed, plan) as batch:
        cache = batch.staged[0].cache
        BatchRunner(model).run(batch.requests, plan, batch)
        slabs = {cache.key_slab.untyped_storage().data_ptr(), cache.value_slab.untyped_storage().data_ptr()}
    engine.close()
    assert viewed  # every load went through the spy
    assert any(p in slabs for p in viewed) is (not is_staged)


def test_store_get_lands_on_the_models_device(loaded_models, device, tmp_path):
    model = loaded_models(device)
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    chunk, key = _stored_chunk(model, store)
    got = store.get(key, model)
    assert got.keys.device.type == model.device.type and torch.equal(got.keys.cpu(), chunk.keys.cpu())



def _stage_onto_pooled_slabs(model, store, keyed, plan, capacity):
    """One staged run whose caches take slabs made under inference mode (as a pass of the runner or
    of decoding makes them) and pooled: `capacity` rows each, what the batch's caches ask for."""
    with torch.inference_mode():
        made = [model.new_cache(capacity) for _ in keyed]
    for cache in made:
        cache.release()
    reused = model.kv_pool.num_reused
    engine = TransferEngine(store, model, TransferConfig(is_staged=True))
    with engine.stage(keyed, plan) as batch:
        assert all(st.cache.key_slab.is_inference() for st in batch.staged)
        out = BatchRunner(model).run(batch.requests, plan, batch)
    engine.close()
    assert model.kv_pool.num_reused == reused + 2 * len(keyed)
    return out


def test_loader_threads_fill_pooled_slabs_made_under_inference_mode(loaded_models, device, tmp_path):
    """Loader threads copy into the cache outside the runner's inference mode unless they enter it
    themselves: torch refused ("Inplace update to inference tensor outside InferenceMode") once a
    pooled slab had been made under it. Walked on CPU's staged route and on the simulated device."""
    model = loaded_models(device)
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    reqs, keyed = stored_requests(model, store, seeds=(3,))
    plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
    ref = BatchRunner(model).run(reqs, plan)[0]
    capacity = reqs[0].prefix.num_tokens + sum(c.num_tokens for c in reqs[0].chunks) + len(reqs[0].suffix_ids)
    out = _stage_onto_pooled_slabs(model, store, keyed, plan, capacity)[0]
    assert torch.equal(out.logits.cpu(), ref.logits.cpu())


class _SpyBackend:
    """The simulation's backend, logging the stream calls staging makes (`log`, shared with the pool)."""

    def __init__(self, inner, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def new_stream(self, device):
        return _SpyStream(self.inner.new_stream(device), "side", self.log)

    def current_stream(self, device):
        return _SpyStream(self.inner.current_stream(device), "compute", self.log)

    def stream(self, stream):
        return self.inner.stream(stream.inner if isinstance(stream, _SpyStream) else stream)

    def record_stream(self, tensor, stream) -> None:
        self.log.append(f"record_stream {stream.name}")
        self.inner.record_stream(tensor, stream.inner)


class _SpyStream:
    """Logs its waits and passes them on (the simulated device orders the streams by them)."""

    def __init__(self, inner, name: str, log: list[str]) -> None:
        self.inner, self.name, self.log = inner, name, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits {other.name}")
        self.inner.wait_stream(other.inner)

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits event")
        self.inner.wait_event(event)


@pytest.mark.sim_cuda
def test_side_stream_copies_wait_for_the_last_use_of_the_batchs_slabs(tiny_llama_dir, sim_cuda, tmp_path,
                                                                     monkeypatch):
    """A pooled slab may have been given back while work on it is still queued on the compute stream
    (a cache moved to head-major on the decode thread gives its old slabs back at once): the side
    stream must wait for the compute stream after the batch's slabs are taken, not before. Each copy
    marks its destination as used by the side stream, so a slab freed mid-copy is not reused."""
    from cachesmith.model import device as accel

    model = Decoder(tiny_llama_dir[0], "cuda")
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    _, keyed = stored_requests(model, store, seeds=(3,))
    log: list[str] = []
    take = model.kv_pool.take
    monkeypatch.setattr(model.kv_pool, "take", lambda *a, **k: log.append("take") or take(*a, **k))
    previous = accel.use_backend(_SpyBackend(accel.backend(), log))
    try:
        engine = TransferEngine(store, model)
        plan = RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3)
        with engine.stage(keyed, plan) as batch:
            BatchRunner(model).run(batch.requests, plan, batch)
        engine.close()
    finally:
        accel.use_backend(previous)
    first_wait = log.index("side waits compute")
    assert max(i for i, e in enumerate(log) if e == "take") < first_wait  # every slab taken before it
    assert log.count("record_stream side") >= 2 * model.num_layers  # K and V of every layer, at least
    assert "compute waits event" in log


@pytest.mark.parametrize("blocks", [None, [0, 2]], ids=["all", "blocks-0-2"])
def test_an_encoded_entry_is_decoded_where_the_cache_lives(loaded_models, device, tmp_path, blocks, monkeypatch):
    """int8 blocks bound for a device cross as stored bytes and are decoded there, into exactly
    what a host read decodes; on the CPU the host decodes them into the destination."""
    from cachesmith.kvstore import codec, staging

    model = loaded_models(device)
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path, codec="int8"))
    chunk, key = _stored_chunk(model, store)
    layer, shape = 1, chunk.keys.shape[1:]  # [T, Hkv, D]
    direct_k, direct_v = torch.zeros(shape, dtype=chunk.dtype), torch.zeros(shape, dtype=chunk.dtype)
    with _opened(store, key, model) as reader:
        reader.read_blocks_into(layer, direct_k, direct_v, blocks)
        stored = sum(reader.header.block_bytes(is_v, min(BLOCK_ROWS, shape[0] - b * BLOCK_ROWS))
                     for b in (blocks if blocks is not None else range(3)) for is_v in (False, True))
    decoded_on = []
    real = codec.decode_into
    monkeypatch.setattr(staging.kv_codec, "decode_into", lambda c, raw, *a: (decoded_on.append(raw.device.type),
                                                                            real(c, raw, *a)))
    k_dst = torch.full(shape, -7.0, dtype=chunk.dtype, device=model.device)
    v_dst = torch.full(shape, -7.0, dtype=chunk.dtype, device=model.device)
    copies = StagingPath(model.device, is_staged=True).batch()
    with _opened(store, key, model) as reader:
        nbytes = copies.load(reader, layer, k_dst, v_dst, blocks)
    copies.wait_layer(layer)
    read = (direct_k != 0).any(-1).any(-1)
    decoded = 2 * int(read.sum()) * chunk.keys[0, 0].numel() * chunk.keys.element_size()
    assert nbytes == stored < 0.3 * decoded  # the stored bytes crossed, not the decoded ones
    assert torch.equal(k_dst.cpu()[read], direct_k[read]) and torch.equal(v_dst.cpu()[read], direct_v[read])
    assert bool((k_dst.cpu()[~read] == -7.0).all())
    runs = 1 if blocks is None else 2
    assert decoded_on == [model.device.type] * 2 * runs  # K and V of each run, where the cache lives
