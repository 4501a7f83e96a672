"""Chunk KV computed in isolation and placed at an offset (pre-RoPE storage)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.model.chunk import extend_chunk


def test_repositioned_chunk_keys_equal_keys_computed_at_offset(tiny_model_dir):
    path, _ = tiny_model_dir
    model = Decoder(path)
    ids = torch.arange(10, 40)
    chunk = prefill_chunk(model, ids)
    offset = 57
    cache = model.new_cache(offset + ids.numel())
    model.forward(ids, start=offset, cache=cache)  # same tokens at `offset`, nothing before them
    for layer in range(model.num_layers):
        placed = chunk.keys_at(model, layer, offset)
        direct = cache.keys[layer][offset:offset + ids.numel()]
        if layer == 0:  # no attention has run yet: the same arithmetic bit for bit
            assert torch.equal(placed, direct)
        # deeper layers see attention at shifted absolute positions: equal up to float32 rounding
        assert (placed - direct).abs().max().item() < 1e-5
        assert torch.allclose(chunk.values[layer], cache.values[layer][offset:offset + ids.numel()],
                              atol=1e-5)


def test_chunk_at_offset_zero_equals_prefill_cache(tiny_llama_dir):
    path, _ = tiny_llama_dir
    model = Decoder(path)
    ids = torch.arange(3, 23)
    chunk = prefill_chunk(model, ids)
    _, cache = model.prefill(ids)
    assert chunk.token_ids == tuple(range(3, 23))
    assert chunk.keys.shape == (model.num_layers, 20, model.config.num_kv_heads, model.config.head_dim)
    for layer in range(model.num_layers):
        assert torch.equal(chunk.keys_at(model, layer, 0), cache.keys[layer][:20])


def test_chunk_from_other_model_or_dtype_is_rejected(tiny_llama_dir):
    path, _ = tiny_llama_dir
    model = Decoder(path)
    chunk = prefill_chunk(model, [4, 5, 6])
    chunk.check_compatible(model)
    with pytest.raises(InputError, match="computed by model"):
        dataclasses.replace(chunk, model_fingerprint="0" * 32).check_compatible(model)
    with pytest.raises(InputError, match="dtype"):
        dataclasses.replace(chunk, keys=chunk.keys.bfloat16(), values=chunk.values.bfloat16()
                            ).check_compatible(model)
    with pytest.raises(InputError, match="chunk token_ids"):
        prefill_chunk(model, [])


def test_extending_a_stored_prefix_equals_prefilling_it_all(tiny_model_dir):
    path, _ = tiny_model_dir
    model = Decoder(path)
    head, tail = torch.arange(5, 25), torch.arange(30, 41)
    whole = prefill_chunk(model, torch.cat([head, tail]))
    base = prefill_chunk(model, head)
    extended = extend_chunk(model, base, tail.tolist())
    assert extended.token_ids == whole.token_ids
    # the base rows are reused as they are (a GEMM over 20 rows need not round as one over 31 does,
    # so the rows of the whole prefill are only close; seen on AMD EPYC without AVX-512)
    assert torch.equal(extended.keys[:, :20], base.keys) and torch.equal(extended.values[:, :20], base.values)
    assert (extended.keys - whole.keys).abs().max().item() < 1e-5
    assert (extended.values - whole.values).abs().max().item() < 1e-5


def test_ensure_prefix_extends_the_longest_stored_earlier_prefix(tiny_llama_dir):
    from cachesmith.kvstore import ChunkStore, StoreConfig
    from cachesmith.pipeline import RagPipeline

    pipe = RagPipeline.__new__(RagPipeline)  # only the model and the store are needed here
    pipe.model, pipe.store = Decoder(tiny_llama_dir[0]), ChunkStore(StoreConfig(tiers=("memory",)))
    first, second, third = list(range(5, 15)), list(range(5, 22)), list(range(5, 30))
    assert pipe.ensure_prefix(first)[1] == 0  # nothing stored: prefilled whole
    assert pipe.ensure_prefix(first)[1] == 10  # stored: all of it
    assert pipe.ensure_prefix(second, [first, [99, 98]])[1] == 10  # extends `first`; [99, 98] is no prefix
    key, num_stored = pipe.ensure_prefix(third, [first, second])
    assert num_stored == 17 and pipe.store.get(key, pipe.model).token_ids == tuple(third)
