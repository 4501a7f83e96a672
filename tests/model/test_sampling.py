"""Token choice: greedy, seeded sampling, top-k / top-p, penalties, log-probabilities, bad values."""
from __future__ import annotations

import math

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.model.sampling import Sampler, SamplingParams, greedy_ids


def _logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler.choose(logits)[0] for _ in range(n)]


def test_greedy_is_argmax_and_same_seed_repeats():
    logits = _logits()
    assert _draws(SamplingParams(), logits, 3) == [int(logits.argmax())] * 3
    hot = SamplingParams(temperature=1.5, seed=42)
    assert _draws(hot, logits, 40) == _draws(hot, logits, 40)
    assert _draws(hot, logits, 40) != _draws(SamplingParams(temperature=1.5, seed=43), logits, 40)


def test_batch_greedy_ids_are_each_rows_choice_ties_included():
    rows = torch.stack([_logits(seed) for seed in range(4)])  # [4, vocab]
    rows[1, 7] = rows[1, 30] = rows[1].max() + 1  # a tie: the lowest id, as one row's argmax
    assert greedy_ids(rows).tolist() == [Sampler().choose(row)[0] for row in rows]
    assert greedy_ids(rows)[1] == 7


@pytest.mark.parametrize("params, is_plain", [(SamplingParams(), True), (SamplingParams(temperature=1e-8), True),
                                              (SamplingParams(num_logprobs=0), False),
                                              (SamplingParams(presence_penalty=0.5), False),
                                              (SamplingParams(temperature=0.7), False)])
def test_only_plain_greedy_rows_are_chosen_on_the_device(params, is_plain):
    assert params.is_plain_greedy == is_plain


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-8])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    logits = _logits(2) * 30  # large logits: logits / temperature is inf in float32
    assert _draws(SamplingParams(temperature=temperature, seed=0), logits, 3) == [int(logits.argmax())] * 3


def test_sampling_follows_the_softmax():
    logits = torch.tensor([0.0, math.log(3.0)])  # probabilities 1/4 and 3/4
    draws = _draws(SamplingParams(temperature=1.0, seed=0), logits, 4000)
    assert abs(sum(draws) / len(draws) - 0.75) < 0.03


def test_top_k_and_top_p_keep_only_the_likeliest():
    logits = _logits(1)
    best = int(logits.argmax())
    assert set(_draws(SamplingParams(temperature=2.0, top_k=1, seed=1), logits, 50)) == {best}
    assert set(_draws(SamplingParams(temperature=2.0, top_p=1e-6, seed=1), logits, 50)) == {best}
    # the smallest positive double is 0 in float32: the likeliest token still stays (the fuzzer's find)
    assert set(_draws(SamplingParams(temperature=2.0, top_p=5e-324, seed=1), logits, 5)) == {best}
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(_draws(SamplingParams(temperature=2.0, top_k=3, seed=2), logits, 300)) <= top3
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    nucleus = int((torch.cumsum(probs[order], 0) < 0.9).sum()) + 1  # smallest set reaching 0.9
    kept = set(order[:nucleus].tolist())
    drawn = set(_draws(SamplingParams(temperature=1.0, top_p=0.9, seed=3), logits, 500))
    assert drawn <= kept and len(drawn) > 1


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([2.0, 1.5, 0.0])
    assert _draws(SamplingParams(), logits, 2) == [0, 0]
    # presence subtracts once per used token: 0 stays at 1.0 however often it comes, 1 at 0.5
    assert _draws(SamplingParams(presence_penalty=1.0), logits, 4) == [0, 1, 0, 0]
    # frequency subtracts per use: after two 0s it is at 0.0, below 1's 0.5
    assert _draws(SamplingParams(frequency_penalty=1.0), logits, 4) == [0, 1, 0, 1]


def test_logprobs_are_the_models_own():
    logits = _logits(2)
    token, record = Sampler(SamplingParams(num_logprobs=3)).choose(logits)
    expected = torch.log_softmax(logits, -1)
    assert token == record.token_id == record.top[0][0]
    assert record.logprob == pytest.approx(float(expected[token]), abs=1e-6)
    assert [t for t, _ in record.top] == torch.topk(expected, 3).indices.tolist()
    # sampled at a temperature, the reported logprob is still the raw model's
    token, record = Sampler(SamplingParams(temperature=2.0, seed=5, num_logprobs=0)).choose(logits)
    assert record.logprob == pytest.approx(float(expected[token]), abs=1e-6) and record.top == ()
    assert Sampler(SamplingParams()).choose(logits)[1] is None


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"temperature": 2.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.2}, "top_p"), ({"top_k": -1}, "top_k"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"num_logprobs": 21}, "top_logprobs"),
    ({"seed": 2**64}, "seed"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InputError, match=f"^{field}="):
        SamplingParams(**kwargs)
