"""Chunk KV computed in isolation and placed at an offset (pre-RoPE storage)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.model import Decoder, prefill_chunk


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
