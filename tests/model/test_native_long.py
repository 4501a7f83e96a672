"""The decode kernels (`model.native`) at the context lengths RAG serves: attention against float64
SDPA at 4K-16K keys, and a greedy decode after an 8K-token prefill on the packaged model, token for
token equal to torch's kernels."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import native
from cachesmith.model.decode import decode_step
from tests.model.test_native import _sdpa

DTYPES = [pytest.param(torch.float32, marks=pytest.mark.skipif(not native.supports(torch.float32),
                                                               reason="no AVX-512 kernels here")),
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not native.supports(torch.bfloat16),
                                                                reason="no AVX512_BF16 here"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_keys", [4096, 8192, 16384])
@pytest.mark.parametrize("is_head_major", [False, True])
def test_attention_equals_float64_sdpa_at_long_contexts(dtype, num_keys, is_head_major):
    """The packaged model's heads (9 over 3 KV heads of 64), a cache with spare rows, written through
    the kernel's new-row path as decoding writes it, in a sequence beside a short one."""
    g = torch.Generator().manual_seed(num_keys)
    capacity = num_keys + 64
    if is_head_major:
        slab = torch.randn(2, 3, capacity, 64, generator=g).to(dtype).transpose(1, 2)  # [K|V, T, Hkv, D] view
    else:
        slab = torch.randn(2, capacity, 3, 64, generator=g).to(dtype)
    short = torch.randn(2, 40, 3, 64, generator=g).to(dtype)
    layouts = native.kv_layouts([slab[0], short[0]], [slab[1], short[1]], [num_keys, 33])
    q = (2 * torch.randn(2, 9, 64, generator=g)).to(dtype)  # a peaked softmax too
    k_new, v_new = torch.randn(2, 2, 3, 64, generator=g).to(dtype)
    out = native.decode_attention(q, 3, layouts, 0, k_new, v_new)  # [2, 9 * 64]
    assert torch.equal(slab[0, num_keys - 1], k_new[0]) and torch.equal(slab[1, num_keys - 1], v_new[0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the output rounded once
    assert (out[0].double() - _sdpa(q[0], slab[0, :num_keys], slab[1, :num_keys])).abs().max().item() <= tol
    assert (out[1].double() - _sdpa(q[1], short[0, :33], short[1, :33])).abs().max().item() <= tol


def _context_ids(tok, num_tokens: int) -> list[int]:
    """Natural text (the packaged Wikipedia extracts, or their seeded fallback) of `num_tokens` tokens."""
    from cachesmith.workloads.corpus import load_corpus

    ids: list[int] = []
    for passage in load_corpus().passages:
        ids += tok.encode(f"{passage.title}\n{passage.text}\n\n")
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise AssertionError("the corpus holds fewer tokens than asked")


def _greedy(model, cache, first: int, num_tokens: int) -> tuple[list[int], torch.Tensor]:
    token, tokens, logits = first, [], []
    for _ in range(num_tokens):
        step = decode_step(model, [token], [cache])[0]  # [vocab]
        token = int(step.argmax())
        tokens.append(token)
        logits.append(step)
    return tokens, torch.stack(logits)


@pytest.mark.real_model
@pytest.mark.slow  # an 8K prefill, then decode, on the packaged model (make sanitize runs it too)
@pytest.mark.skipif(not native.supports(torch.float32), reason="no AVX-512 kernels here")
def test_decode_after_an_8k_prefill_equals_torch_kernels(real_model):
    """64 greedy tokens after an 8,128-token prefill (the model's 8,192 positions, filled): the
    native kernels (every layer in one call) and torch's give the same tokens, logits within 1e-3."""
    model, tok = real_model
    ids = _context_ids(tok, model.config.max_positions - 64)
    logits, cache = model.prefill(ids, extra_capacity=64)
    cache.to_head_major()  # as decoding moves it
    other = cache.clone()
    first = int(logits.argmax())
    rows, is_attention = model.native_rows, model.is_native_attention
    try:
        model.use_native(native.MAX_NATIVE_ROWS, True)
        assert model.native_layer_table is not None
        ours, our_logits = _greedy(model, cache, first, 64)
        model.use_native(0, False)
        theirs, their_logits = _greedy(model, other, first, 64)
    finally:
        model.use_native(rows, is_attention)
    assert cache.num_tokens == other.num_tokens == model.config.max_positions
    difference = (our_logits - their_logits).abs().max().item()
    print(f"8K context: max abs logit difference {difference:.2e} over 64 tokens")
    assert ours == theirs and difference <= 1e-3
