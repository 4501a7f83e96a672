"""Text building blocks shared by the task generators: sentence splitting, filler chunks of real
passages at a target length, inserting a sentence at a sentence boundary, fictional names.

In: a `Corpus` and a seeded `random.Random`. Out: strings. Everything is deterministic given the rng.
"""
from __future__ import annotations

import random
import re

from cachesmith.workloads.corpus import Corpus, Passage
from cachesmith.workloads.words import word_lists

# SmolLM2's tokenizer averages ~1.3 tokens per English word on the Wikipedia extracts; generators
# size chunks in words with it and the dataset card reports the measured token lengths.
TOKENS_PER_WORD = 1.3

# An own splitter (nltk's punkt needs a download at run time, and nothing but the registries is
# fetched then): a sentence ends at . ! or ? followed by
# white space and an upper-case letter, digit or quote, unless the period ends a common abbreviation.
_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_ABBREVIATIONS = ("Mr.", "Mrs.", "Ms.", "Dr.", "St.", "Jr.", "Sr.", "vs.", "e.g.", "i.e.", "c.", "ca.",
                  "No.", "U.S.", "U.K.", "Inc.", "Ltd.", "Co.", "Mt.", "Ft.")

FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
    "Lars", "Maya", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Stefan", "Tamsin", "Ulrich", "Vera",
    "Walter", "Xenia", "Yusuf", "Zora", "Anton", "Beatrix", "Cyrus", "Dalia", "Emil", "Fiona", "Gideon",
    "Helga", "Ivan", "Juno", "Kasper", "Lena", "Milo", "Nora", "Otto", "Petra", "Rafael", "Sonja",
    "Tobias", "Ursula", "Viktor", "Wanda", "Yara", "Zeno",
)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, never splitting after an abbreviation; joins back to `text` modulo spaces."""
    pieces = _BOUNDARY.split(text.strip())
    sentences: list[str] = []
    for piece in pieces:
        if sentences and sentences[-1].endswith(_ABBREVIATIONS):
            sentences[-1] = f"{sentences[-1]} {piece}"
        else:
            sentences.append(piece)
    return [s.strip() for s in sentences if s.strip()]


def num_words(text: str) -> int:
    return len(text.split())


def filler(rng: random.Random, corpus: Corpus, target_tokens: int,
           exclude: frozenset[str] = frozenset()) -> str:
    """Whole real passages appended until about `target_tokens` tokens (at least one passage)."""
    parts, words = [], 0
    while not parts or words * TOKENS_PER_WORD < target_tokens:
        passage = rng.choice(corpus.passages)
        if passage.title in exclude:
            continue
        parts.append(passage.text.replace("\n", " "))
        words += num_words(passage.text)
    return " ".join(parts)


def insert_sentence(rng: random.Random, text: str, sentence: str) -> str:
    """`sentence` placed at a random sentence boundary of `text` (start and end included)."""
    sentences = split_sentences(text)
    sentences.insert(rng.randrange(len(sentences) + 1), sentence)
    return " ".join(sentences)


def pick_passages(rng: random.Random, corpus: Corpus, count: int, min_words: int,
                  max_words: int) -> list[Passage]:
    """`count` distinct passages within a word range, with distinct titles and descriptions."""
    pool = [p for p in corpus.passages if min_words <= num_words(p.text) <= max_words and p.description]
    if len(pool) < count:
        raise ValueError(f"corpus {corpus.source!r} has {len(pool)} passages of {min_words}-{max_words} "
                         f"words with a description; {count} are needed")
    chosen: list[Passage] = []
    seen: set[str] = set()
    while len(chosen) < count:
        p = rng.choice(pool)
        if p.title.lower() not in seen and p.description.lower() not in seen:
            seen.update((p.title.lower(), p.description.lower()))
            chosen.append(p)
    return chosen


def person_names(rng: random.Random, count: int) -> list[str]:
    """`count` fictional "First Surname" names sharing no word (surnames: capitalized nouns)."""
    _, nouns = word_lists()
    firsts = rng.sample(FIRST_NAMES, count)
    surnames = rng.sample([n for n in nouns if 4 <= len(n) <= 8], count)
    return [f"{f} {s.capitalize()}" for f, s in zip(firsts, surnames)]


def place_names(rng: random.Random, count: int) -> list[str]:
    """`count` fictional town names such as "Port Lantern" or "Amberfield", sharing no stem."""
    adjectives, nouns = word_lists()
    stems = rng.sample([n for n in nouns if 4 <= len(n) <= 7], count)
    forms = ("Port {}", "{}field", "{}ton", "Lake {}", "{}burg", "New {}")
    return [rng.choice(forms).format(s.capitalize()) for s in stems]
