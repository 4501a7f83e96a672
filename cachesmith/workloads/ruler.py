"""RULER-style synthetic tasks, written from RULER's published description (not its code), with
real Wikipedia text as the haystack instead of essays.

- VT, variable tracking: a chain `VAR A = <number>`, `VAR B = VAR A`, ... with every assignment in
  a different chunk, plus distractor chains with other values; the question asks for every variable
  assigned the value. Gold: the chain's variable names; set F1 > 0.5 passes.
- VT `kv-split`: assignments cut at chunk boundaries, asking one variable's value (see below).
- MV, multi-value needle: `num_values` magic numbers for one key, each in a distinct chunk, plus
  needles for distractor keys; the question asks for all of the key's numbers.
"""
from __future__ import annotations

import random
import string

from cachesmith.workloads.corpus import Corpus
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.text import filler, insert_sentence
from cachesmith.workloads.words import distinct_keys

NEEDLE = "One of the special magic numbers for {key} is: {number}."


def _haystack(rng: random.Random, corpus: Corpus, num_chunks: int, chunk_tokens: int) -> list[str]:
    return [filler(rng, corpus, chunk_tokens) for _ in range(num_chunks)]


def _variable_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:  # a list, not a set: set order varies with PYTHONHASHSEED
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def variable_tracking(corpus: Corpus, seed: int, variant: str = "default", num_chunks: int = 8,
                      num_hops: int = 4, num_chains: int = 1, chunk_tokens: int = 200) -> WorkloadInstance:
    """`num_hops` hops = `num_hops + 1` assignments per chain, each chain spread over distinct chunks."""
    rng = random.Random(seed)
    docs = _haystack(rng, corpus, num_chunks, chunk_tokens)
    names = _variable_names(rng, num_chains * (num_hops + 1))
    values = rng.sample(range(10_000, 100_000), num_chains)
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    placements = []
    for chain, value in zip(chains, values):
        slots = sorted(rng.sample(range(num_chunks), num_hops + 1))  # the chain reads left to right
        statements = [f"VAR {chain[0]} = {value}."] + [
            f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
        for slot, statement in zip(slots, statements):
            docs[slot] = insert_sentence(rng, docs[slot], statement)
        placements.append(slots)
    question = (f"Find all variables that are assigned the value {values[0]} in the text above, "
                f"directly or through other variables.")
    return WorkloadInstance(
        task="vt", variant=variant, documents=tuple(docs), question=question, gold=tuple(chains[0]),
        prefix="Memorize and track the chain(s) of variable assignment hidden in the following text.",
        answer_prefix=(f"According to the chain(s) of variable assignment in the text above, "
                       f"{num_hops + 1} variables are assigned the value {values[0]}, they are:"),
        max_new_tokens=8 * (num_hops + 1),
        metadata={"seed": seed, "num_chunks": num_chunks, "num_hops": num_hops,
                  "evidence_chunks": placements[0], "distractor_values": values[1:]},
    )


def split_assignments(corpus: Corpus, seed: int, variant: str = "kv-split", num_chunks: int = 8,
                      num_keys: int = 4, chunk_tokens: int = 150) -> WorkloadInstance:
    """VT's closest variant for small models (SmolLM2-135M scores ~0 on RULER VT, even 1-hop): a
    multi-key needle whose key and value sit in different chunks. Each of `num_keys` statements
    "One of the special magic numbers for KEY is: VALUE." is cut at a chunk boundary (the key ends
    one chunk, the value opens the next, as when documents are split into fixed-size chunks); the
    question asks one key's value. Reading it back needs the attention across the boundary that
    isolated prefill loses."""
    rng = random.Random(seed)
    docs = _haystack(rng, corpus, num_chunks, chunk_tokens)
    keys = distinct_keys(rng, num_keys)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), num_keys)]
    boundaries = sorted(rng.sample(range(num_chunks - 1), num_keys))  # after chunk b, before b + 1
    for b, key, value in zip(boundaries, keys, values):
        head, _, _ = NEEDLE.format(key=key, number="").rpartition(" ")
        docs[b] = f"{docs[b]} {head}"
        docs[b + 1] = f"{value}. {docs[b + 1]}"
    target = rng.randrange(num_keys)
    return WorkloadInstance(
        task="vt", variant=variant, documents=tuple(docs),
        question=f"What is the special magic number for {keys[target]} mentioned in the text above?",
        gold=(values[target],),
        prefix="Some special magic numbers are hidden within the following text. Make sure to memorize them.",
        answer_prefix=f"The special magic number for {keys[target]} is:", max_new_tokens=8,
        metadata={"seed": seed, "num_chunks": num_chunks, "item_pattern": r"\b\d{7}\b",
                  "evidence_chunks": [boundaries[target], boundaries[target] + 1],
                  "distractor_values": [v for i, v in enumerate(values) if i != target]},
    )


def multi_value(corpus: Corpus, seed: int, variant: str = "default", num_chunks: int = 8,
                num_values: int = 4, num_distractors: int = 2, chunk_tokens: int = 200) -> WorkloadInstance:
    rng = random.Random(seed)
    docs = _haystack(rng, corpus, num_chunks, chunk_tokens)
    keys = distinct_keys(rng, 1 + num_distractors)
    numbers = rng.sample(range(1_000_000, 10_000_000), num_values + num_distractors)
    target_numbers = [str(n) for n in numbers[:num_values]]
    target_slots = sorted(rng.sample(range(num_chunks), num_values))
    for slot, number in zip(target_slots, target_numbers):
        docs[slot] = insert_sentence(rng, docs[slot], NEEDLE.format(key=keys[0], number=number))
    distractor_slots = [rng.randrange(num_chunks) for _ in range(num_distractors)]
    for slot, key, number in zip(distractor_slots, keys[1:], numbers[num_values:]):
        docs[slot] = insert_sentence(rng, docs[slot], NEEDLE.format(key=key, number=number))
    return WorkloadInstance(
        task="mv", variant=variant, documents=tuple(docs),
        question=f"What are all the special magic numbers for {keys[0]} mentioned in the text above?",
        gold=tuple(target_numbers),
        prefix="Some special magic numbers are hidden within the following text. Make sure to memorize them.",
        answer_prefix=f"The special magic numbers for {keys[0]} mentioned in the text are:",
        max_new_tokens=10 * num_values + 4,
        metadata={"seed": seed, "num_chunks": num_chunks, "key": keys[0],
                  "evidence_chunks": target_slots, "distractor_chunks": distractor_slots,
                  "distractor_keys": keys[1:]},
    )
