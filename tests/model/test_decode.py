"""Batched decode steps, prepacked small-row linears and continuous decoding, on tiny random models
(float32), against the one-sequence reference `Decoder.decode_step`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachesmith.errors import InputError
from cachesmith.model import Decoder, Decoding, greedy_decode
from cachesmith.model.decode import decode_step
from cachesmith.model.linear import MAX_PACKED_ROWS, Linear


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_linear_agrees_with_f_linear_at_every_row_count(dtype, tol):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    lin = Linear(weight, bias)
    # where torch has oneDNN (x86 wheels), the small-row path runs (and is what is compared below)
    assert (lin.packed is not None) == (torch.backends.mkldnn.is_available()
                                        and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    for rows in (1, 2, 7, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 100):
        x = torch.randn(rows, 40, generator=g).to(dtype)
        assert (lin(x).float() - F.linear(x, weight, bias).float()).abs().max().item() <= tol
    strided = torch.randn(5, 80, generator=g).to(dtype)[:, ::2]  # a non-contiguous input
    assert (lin(strided).float() - F.linear(strided, weight, bias).float()).abs().max().item() <= tol


def test_batched_step_equals_each_sequence_alone(tiny_model_dir):
    path, _ = tiny_model_dir
    model = Decoder(path)
    lengths = (5, 17, 30)  # different positions in one step
    alone, together = [], []
    for n, seed in zip(lengths, range(3)):
        _, c1 = model.prefill(_ids(n, seed), extra_capacity=4)
        _, c2 = model.prefill(_ids(n, seed), extra_capacity=4)
        alone.append(c1)
        together.append(c2)
    tokens = [7, 11, 13]
    for _ in range(3):  # several steps: each cache grows by one row per step
        ref = torch.stack([model.decode_step(t, c) for t, c in zip(tokens, alone)])
        out = decode_step(model, tokens, together)
        assert (out - ref).abs().max().item() < 1e-4
        assert [c.num_tokens for c in together] == [c.num_tokens for c in alone]
        tokens = ref.argmax(-1).tolist()


def test_decode_step_refuses_mismatched_inputs(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    _, cache = model.prefill(_ids(4, 0))
    with pytest.raises(InputError, match="2 token ids for 1 caches"):
        decode_step(model, [1, 2], [cache])


def test_sequences_joining_and_leaving_decode_as_alone(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    expected = []
    for seed, budget in ((0, 12), (1, 4), (2, 9)):
        logits, cache = model.prefill(_ids(8 + seed, seed), extra_capacity=16)
        expected.append(greedy_decode(model, logits, cache, budget, eos_token_ids=()))
    decoding = Decoding(model)
    gens, seen = [], []
    for step, (seed, budget) in enumerate(((0, 12), (1, 4), (2, 9))):
        logits, cache = model.prefill(_ids(8 + seed, seed), extra_capacity=16)
        gens.append(decoding.start(logits, cache, budget, eos_token_ids=()))
        seen.append(len(decoding.active))
        decoding.step()  # the next sequence joins after this step
    decoding.run()
    assert [g.token_ids for g in gens] == expected
    assert seen == [1, 2, 3]  # every sequence was stepped beside the others
    assert all(g.is_done and not decoding.active for g in gens)


def test_generation_stops_at_the_models_last_position(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    limit = model.config.max_positions
    logits, cache = model.prefill(_ids(limit - 3, 0), extra_capacity=8)
    ids = greedy_decode(model, logits, cache, 50, eos_token_ids=())
    # prompt and answer fill the positions; the last token is never fed back, so takes no row
    assert len(ids) == 3 and cache.num_tokens == limit - 1
