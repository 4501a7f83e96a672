"""Store tier bandwidth: how fast each tier delivers a stored chunk's KV into a cache on the model's
device, layer by layer, as the transfer engine loads it (checksums verified on the host; on a GPU
the pinned staging buffer and its copy to the device are part of the time).

In: a `Decoder`, tier names (and a redis URL if asked). Out: {tier: GB/s}, the median over
repeated whole-entry reads of `num_tokens` random tokens. The disk figure includes the page cache
once the file is hot, as a serving process would see it.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.staging import StagingPath
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.model import device as accel


def _read_all(reader, num_layers: int, k: torch.Tensor, v: torch.Tensor, path: StagingPath) -> int:
    """Every layer into k, v [T, Hkv, D] on the model's device, the copies finished."""
    staging = path.batch()
    nbytes = sum(staging.load(reader, layer, k, v, None) for layer in range(num_layers))
    staging.wait_all()
    accel.synchronize(k.device)  # timing only: the copies are done when the clock stops
    return nbytes


def tier_bandwidth(model: Decoder, tiers: tuple[str, ...] = ("memory", "disk"), num_tokens: int = 2048,
                   repeats: int = 5, redis_url: str | None = None, root: Path | None = None) -> dict[str, float]:
    rng = random.Random(0)
    chunk = prefill_chunk(model, [rng.randrange(model.config.vocab_size) for _ in range(num_tokens)])
    shape = chunk.keys.shape[1:]  # [T, Hkv, D]
    k = torch.empty(shape, dtype=chunk.keys.dtype, device=model.device)
    v = torch.empty(shape, dtype=chunk.keys.dtype, device=model.device)
    path = StagingPath(model.device)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tier in tiers:
            store = ChunkStore(StoreConfig(tiers=(tier,), root=root or Path(tmp), redis_url=redis_url))
            key = store.put(chunk)
            speeds = []
            for _ in range(repeats + 1):  # the first read warms caches and is dropped
                reader = store.open(key, model)
                start = time.perf_counter()
                nbytes = _read_all(reader, model.num_layers, k, v, path)
                speeds.append(nbytes / (time.perf_counter() - start) / 1e9)
                reader.close()
            store.delete(key)
            out[tier] = statistics.median(speeds[1:])
    return out
