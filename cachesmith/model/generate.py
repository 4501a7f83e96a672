"""Decoding from filled KV caches (after a full prefill or an assembled recompute), many sequences
stepped together.

In: per sequence the logits of its last prompt position, its cache, a token budget, `SamplingParams`
and an optional `on_token(index, token_id)` that hears each kept token as soon as it is chosen (a
server streams from it). Out: per sequence the generated token ids (stopping at an end-of-sequence
id, not included, or after `max_new_tokens`) and, when asked, their log-probabilities.

`start_generation` chooses a sequence's first token at once (it is the request's TTFT);
`Decoding` holds the sequences being decoded: `step` chooses everyone's next token in one
`decode_step`, and sequences join and leave between steps. The caller owns the caches (and releases them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from cachesmith.errors import InputError
from cachesmith.model.decode import decode_step
from cachesmith.model.decoder import Decoder
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.sampling import GREEDY, Sampler, SamplingParams, TokenLogprob


@dataclass(eq=False)
class Generation:
    """One sequence being decoded; `token_ids` and `logprobs` grow as it goes."""
    cache: KVCache
    max_new_tokens: int  # also bounded by the model's positions left after the prompt
    sampler: Sampler
    stop_ids: frozenset[int]
    on_token: Callable[[int, int], None] | None = None
    tag: object = None  # the caller's (e.g. which request this is)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    is_done: bool = False
    error: str | None = None  # set by a caller whose decode step failed

    def take(self, logits: torch.Tensor) -> None:
        """Choose the next token from `logits` [vocab]; done at a stop id or when out of room."""
        token, logprob = self.sampler.choose(logits)
        if token in self.stop_ids:
            self.is_done = True
            return
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(len(self.token_ids) - 1, token)
        self.is_done = len(self.token_ids) >= self.max_new_tokens


def start_generation(model: Decoder, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                     params: SamplingParams = GREEDY, on_token: Callable[[int, int], None] | None = None,
                     tag: object = None, eos_token_ids: Iterable[int] | None = None) -> Generation:
    """A sequence's generation with its first token chosen now (it is the request's TTFT)."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    stop = frozenset(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    # every kept token but the last takes a cache row
    limit = min(max_new_tokens, model.config.max_positions - cache.num_tokens)
    gen = Generation(cache, limit, Sampler(params), stop, on_token, tag)
    if limit <= 0:
        gen.is_done = True
    else:
        gen.take(first_logits)
    return gen


MIN_RELAYOUT_TOKENS = 4  # fewer tokens left: moving the cache costs more than its faster attention saves


def prepare_cache(gen: Generation) -> None:
    """Before a sequence's first decode step: its cache moves to the head-major layout with room for
    every token it may still add (no growth copies later), unless only a few are left. Moving costs
    about one copy of the cache (2K float32 tokens: a few ms); it runs where decoding runs, off the
    request's TTFT, and every later step's attention reads each head's keys contiguously."""
    cache = gen.cache
    if cache.is_head_major:
        return
    left = gen.max_new_tokens - len(gen.token_ids)
    if left >= MIN_RELAYOUT_TOKENS:
        cache.to_head_major(capacity=cache.num_tokens + left)


class Decoding:
    """The sequences being decoded together on one model."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.active: list[Generation] = []

    def start(self, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int, **kwargs) -> Generation:
        """`start_generation` on this model, joined to the next step unless already done."""
        gen = start_generation(self.model, first_logits, cache, max_new_tokens, **kwargs)
        self.add(gen)
        return gen

    def add(self, gen: Generation) -> None:
        """Join a generation started elsewhere (e.g. on the prefill thread) to the next step."""
        if not gen.is_done:
            self.active.append(gen)

    def step(self) -> list[Generation]:
        """One decode step over every active sequence; returns those that finished in it."""
        if not self.active:
            return []
        gens = self.active
        for gen in gens:
            prepare_cache(gen)
        logits = decode_step(self.model, [g.token_ids[-1] for g in gens], [g.cache for g in gens])
        for gen, row in zip(gens, logits):  # row: [vocab]
            gen.take(row)
        self.active = [g for g in gens if not g.is_done]
        return [g for g in gens if g.is_done]

    def run(self) -> None:
        """Step until every sequence is done."""
        while self.active:
            self.step()


def greedy_decode(model: Decoder, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                  eos_token_ids: Iterable[int] | None = None,
                  on_token: Callable[[int, int], None] | None = None) -> list[int]:
    """Greedy token ids of one sequence (see `Decoding` for many)."""
    decoding = Decoding(model)
    gen = decoding.start(first_logits, cache, max_new_tokens, on_token=on_token, eos_token_ids=eos_token_ids)
    decoding.run()
    return gen.token_ids
