"""Several needles in different chunks, asking for one key: an answer that needs cross-chunk
attention (measured: full prefill 82.5%, full reuse 37.5% on SmolLM2-135M at ~1.7K tokens).

In: a corpus and a seed. Out: `WorkloadInstance`s with `num_chunks` Wikipedia chunks of about
`chunk_tokens` tokens (estimated at 1.3 tokens per word), `num_needles` of which carry a needle.
"""
from __future__ import annotations

import random

from cachesmith.workloads.corpus import Corpus
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.words import distinct_keys

NEEDLE = "One of the special magic numbers for {key} is: {number}."
TOKENS_PER_WORD = 1.3


def _chunk_text(rng: random.Random, corpus: Corpus, chunk_tokens: int) -> str:
    parts, words = [], 0
    while words * TOKENS_PER_WORD < chunk_tokens:
        text = rng.choice(corpus.passages).text
        parts.append(text)
        words += len(text.split())
    return " ".join(parts)


def _insert(rng: random.Random, text: str, sentence: str) -> str:
    cuts = [i + 2 for i in range(len(text) - 2) if text[i] == "." and text[i + 1] == " "]
    cut = rng.choice(cuts) if cuts else len(text)
    return f"{text[:cut]}{sentence} {text[cut:]}".strip() if cuts else f"{text} {sentence}"


def multi_needle(corpus: Corpus, seed: int, num_chunks: int = 8, num_needles: int = 4,
                 chunk_tokens: int = 200) -> WorkloadInstance:
    rng = random.Random(seed)
    docs = [_chunk_text(rng, corpus, chunk_tokens) for _ in range(num_chunks)]
    keys = distinct_keys(rng, num_needles)
    numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    slots = sorted(rng.sample(range(num_chunks), num_needles))
    for slot, key, number in zip(slots, keys, numbers):
        docs[slot] = _insert(rng, docs[slot], NEEDLE.format(key=key, number=number))
    target = rng.randrange(num_needles)
    return WorkloadInstance(
        task="multi_needle",
        documents=tuple(docs),
        question=f"What is the special magic number for {keys[target]} mentioned in the passages?",
        gold=(numbers[target],),
        answer_prefix=f"The special magic number for {keys[target]} is:",
        metadata={"evidence_chunk": slots[target], "needle_chunks": slots, "seed": seed,
                  "distractors": [n for i, n in enumerate(numbers) if i != target]},
    )
