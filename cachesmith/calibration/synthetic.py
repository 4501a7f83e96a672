"""Random-token requests for timing: the cost of a layer depends on shapes, not on the words.

In: a model, a context length and a seeded rng. Out: a `RecomputeRequest` with precomputed chunk
KV (chunks of 256-512 tokens summing to the context) and its flat token ids; or the same chunks
stored in a given store, as a `StoredPrompt` the transfer engine stages as serving does.
"""
from __future__ import annotations

import random

from cachesmith.kvstore import ChunkStore, StoredEntry, StoredPrompt
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.recompute import RecomputeRequest


def _chunk_sizes(context_tokens: int, rng: random.Random) -> list[int]:
    sizes, left = [], context_tokens
    while left > 0:
        sizes.append(min(left, rng.randint(256, 512)))
        left -= sizes[-1]
    return sizes


def random_prompt(model: Decoder, store: ChunkStore, context_tokens: int, rng: random.Random,
                  num_suffix: int = 32) -> StoredPrompt:
    """A prompt of random-token chunks (256-512 tokens, summing to `context_tokens`) stored in
    `store`, and a random suffix."""
    vocab = model.config.vocab_size
    chunks = []
    for size in _chunk_sizes(context_tokens, rng):
        ids = [rng.randrange(vocab) for _ in range(size)]
        chunks.append(StoredEntry(store.ensure(model, ids)[0], size))
    return StoredPrompt(tuple(chunks), tuple(rng.randrange(vocab) for _ in range(num_suffix)), None)


def random_request(model: Decoder, prefix_ids: list[int], context_tokens: int, rng: random.Random,
                   num_suffix: int = 32) -> tuple[RecomputeRequest, list[int]]:
    vocab = model.config.vocab_size
    chunks = [[rng.randrange(vocab) for _ in range(s)] for s in _chunk_sizes(context_tokens, rng)]
    suffix = [rng.randrange(vocab) for _ in range(num_suffix)]
    prefix = prefill_chunk(model, prefix_ids) if prefix_ids else None
    req = RecomputeRequest([prefill_chunk(model, c) for c in chunks], suffix, prefix)
    return req, prefix_ids + [t for c in chunks for t in c] + suffix
