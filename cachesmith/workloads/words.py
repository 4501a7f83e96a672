"""Word lists from the `wonderwords` package (MIT), read from its bundled assets."""
from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def word_lists() -> tuple[list[str], list[str]]:
    """(adjectives, nouns): lower-case single words, profanity removed."""
    assets = resources.files("wonderwords") / "assets"

    def read(name: str) -> list[str]:
        return [w.strip().lower() for w in (assets / name).read_text().splitlines() if w.strip()]

    banned = set(read("profanitylist.txt"))

    def clean(words: list[str]) -> list[str]:
        return sorted({w for w in words if w.isalpha() and 3 <= len(w) <= 10 and w not in banned})

    return clean(read("adjectivelist.txt")), clean(read("nounlist.txt"))


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    """`count` adjective-noun keys sharing no word (shared words confuse small models)."""
    adjectives, nouns = word_lists()
    return [f"{a}-{n}" for a, n in zip(rng.sample(adjectives, count), rng.sample(nouns, count))]
