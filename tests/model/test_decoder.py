"""Our decoder against transformers' forward and generate on tiny random models (float32)."""
from __future__ import annotations

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.model import Decoder, greedy_decode


def _ids(n: int, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)  # skip 0..2: pad/bos/eos in HF's generate


def test_prefill_logits_match_hf(tiny_model_dir):
    path, hf = tiny_model_dir
    model = Decoder(path)
    ids = _ids(48)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [T, vocab]
    ours = model.head(model.forward(ids))
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_prefill_returns_last_logits_and_full_cache(tiny_llama_dir):
    path, hf = tiny_llama_dir
    model = Decoder(path)
    ids = _ids(20)
    logits, cache = model.prefill(ids)
    with torch.no_grad():
        out = hf(ids[None], use_cache=True)
    assert (logits - out.logits[0, -1]).abs().max().item() < 1e-4
    assert cache.num_tokens == 20
    ref_k = out.past_key_values.layers[1].keys[0].transpose(0, 1)  # [T, Hkv, D], rotated
    assert (cache.view(1)[0] - ref_k).abs().max().item() < 1e-5


def test_greedy_decode_matches_hf_generate(tiny_model_dir):
    path, hf = tiny_model_dir
    model = Decoder(path)
    ids = _ids(32, seed=7)
    logits, cache = model.prefill(ids, extra_capacity=16)
    ours = greedy_decode(model, logits, cache, max_new_tokens=16, eos_token_ids=())
    ref = hf.generate(ids[None], attention_mask=torch.ones(1, 32, dtype=torch.long), max_new_tokens=16,
                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, 32:].tolist()
    assert ours == ref
    assert cache.num_tokens == 32 + 15  # the last generated token is never fed back


def test_greedy_decode_stops_at_eos(tiny_llama_dir):
    path, _ = tiny_llama_dir
    model = Decoder(path)
    logits, cache = model.prefill(_ids(10))
    free = greedy_decode(model, logits.clone(), cache, 8, eos_token_ids=())
    _, cache2 = model.prefill(_ids(10))
    stopped = greedy_decode(model, logits.clone(), cache2, 8, eos_token_ids=[free[2]])
    assert stopped == free[: free.index(free[2])]


def test_bfloat16_close_to_float32(tiny_llama_dir):
    path, _ = tiny_llama_dir
    ids = _ids(40)
    ref, _ = Decoder(path, dtype="float32").prefill(ids)
    low, cache = Decoder(path, dtype="bfloat16").prefill(ids)
    assert cache.keys[0].dtype == torch.bfloat16
    rel = (low - ref).norm() / ref.norm()
    assert rel.item() < 0.05


def test_bad_prompts_are_rejected_by_field(tiny_llama_dir):
    path, _ = tiny_llama_dir
    model = Decoder(path)
    with pytest.raises(InputError, match="non-empty"):
        model.prefill([])
    with pytest.raises(InputError, match="maximum of 256"):
        model.prefill(list(range(3, 100)) * 3)
    with pytest.raises(InputError, match="vocabulary"):
        model.prefill([5, 128])
    with pytest.raises(InputError, match="dtype"):
        Decoder(path, dtype="int8")
    with pytest.raises(InputError, match="max_new_tokens"):
        logits, cache = model.prefill([5, 6])
        greedy_decode(model, logits, cache, -1)


def test_extend_over_a_cache_equals_prefill_of_the_whole(tiny_model_dir):
    model = Decoder(tiny_model_dir[0])
    ids = _ids(40, seed=3)
    ref_logits, ref_cache = model.prefill(ids)
    _, cache = model.prefill(ids[:31], extra_capacity=4)  # grows past its capacity on the way
    hidden = model.extend(ids[31:], cache)  # 9 rows, causal among themselves
    assert cache.num_tokens == 40
    assert (model.head(hidden[-1:])[0] - ref_logits).abs().max().item() < 1e-4
    for layer in range(model.num_layers):
        assert (cache.view(layer)[0] - ref_cache.view(layer)[0]).abs().max().item() < 1e-5


def test_released_cache_slabs_are_reused(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    _, cache = model.prefill(_ids(30))
    slab = cache.key_slab
    cache.release()
    assert cache.keys == [] and cache.num_tokens == 0
    logits, again = model.prefill(_ids(24, seed=2))  # fits in the released slab (24 <= 30 <= 48)
    assert again.key_slab.data_ptr() == slab.data_ptr() and model.kv_pool.num_reused >= 1
    ref, _ = Decoder(tiny_llama_dir[0]).prefill(_ids(24, seed=2))
    assert torch.equal(logits, ref)  # stale rows beyond the prompt never leak into the result
