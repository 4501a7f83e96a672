"""Task generators: determinism, evidence placement, MIX balance, and bad knobs named."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from cachesmith.workloads import corpus as corpus_mod
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.tasks import MIX_TASKS, TASKS, WorkloadError, generate, generate_many
from cachesmith.workloads.text import split_sentences


@pytest.fixture(scope="module")
def corpus():
    # synthetic passages carry no description; PR needs one, so add it for the tests
    base = corpus_mod._synthetic(num=300, seed=2)
    passages = tuple(corpus_mod.Passage(p.title, p.text, f"description {i}") for i, p in enumerate(base.passages))
    return corpus_mod.Corpus(passages, True, base.source)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_variant_is_deterministic_and_seed_sensitive(corpus, task):
    for variant in TASKS[task].variants:
        a, b = generate(task, 11, variant, corpus), generate(task, 11, variant, corpus)
        assert a == b and a.to_json() == b.to_json()
        assert generate(task, 12, variant, corpus) != a
        assert a.task == task and a.variant == variant and a.metadata["seed"] == 11


def test_pr_gold_names_the_described_paragraph(corpus):
    for seed in range(10):
        inst = generate("pr", seed, "title", corpus)
        number = int(re.search(r"\d+", inst.gold[0]).group(0))
        title = inst.metadata["titles"][number - 1]
        assert inst.question == f"Which paragraph is about {title}?"
        assert inst.documents[number - 1].startswith(f"Paragraph {number}: ")
        assert inst.metadata["evidence_chunks"] == [number - 1]


@pytest.mark.parametrize("hops", [1, 2, 3, 4])
def test_msq_hops_sit_in_distinct_chunks(corpus, hops):
    inst = generate("msq", 3, None, corpus, num_hops=hops)
    chain, slots = inst.metadata["chain"], inst.metadata["evidence_chunks"]
    assert len(set(slots)) == hops == len(chain)
    assert inst.gold[0] in inst.documents[slots[-1]]  # the last hop holds the answer
    for i in range(hops - 1):  # hop i links chain[i] to chain[i + 1] inside chunk slots[i]
        assert chain[i] in inst.documents[slots[i]] and chain[i + 1] in inst.documents[slots[i]]
    assert inst.question.count(" of ") == hops - 1
    for place in inst.metadata["distractor_places"]:
        assert any(place in d for d in inst.documents)


def test_vt_chain_reads_in_chunk_order(corpus):
    inst = generate("vt", 4, "4hop", corpus, num_hops=3, num_chains=2)
    slots, chain = inst.metadata["evidence_chunks"], inst.gold
    assert len(chain) == 4 and slots == sorted(set(slots))
    value = inst.question.split("value ")[1].split(" ")[0]
    assert f"VAR {chain[0]} = {value}." in inst.documents[slots[0]]
    for i in range(1, 4):
        assert f"VAR {chain[i]} = VAR {chain[i - 1]}." in inst.documents[slots[i]]
    assert sum(d.count("VAR ") for d in inst.documents) == 8 + 6  # 2 chains x (4 + 3 references)


def test_mv_values_in_distinct_chunks_with_distractors(corpus):
    inst = generate("mv", 5, None, corpus, num_values=4, num_distractors=3)
    key = inst.metadata["key"]
    assert len(set(inst.metadata["evidence_chunks"])) == 4
    for slot, value in zip(inst.metadata["evidence_chunks"], inst.gold):
        assert f"for {key} is: {value}." in inst.documents[slot]
    assert sum(d.count("special magic numbers for") for d in inst.documents) == 7


def test_mix_is_an_equal_draw():
    tasks = [inst.task for inst in generate_many("mix", 40, seed=7, corpus=_tiny_corpus())]
    assert {t: tasks.count(t) for t in MIX_TASKS} == {t: 10 for t in MIX_TASKS}


def _tiny_corpus():
    base = corpus_mod._synthetic(num=60, seed=4)
    return corpus_mod.Corpus(tuple(corpus_mod.Passage(p.title, p.text, f"d{i}") for i, p in enumerate(base.passages)),
                             True, base.source)


@pytest.mark.parametrize("task, variant, knobs, match", [
    ("qa", None, {}, "unknown task 'qa'"),
    ("vt", "9hop", {}, "unknown variant '9hop'"),
    ("mv", None, {"num_values": 9, "num_chunks": 4}, "num_values=9 needs 9 distinct chunks"),
    ("msq", None, {"num_hops": 5, "num_chunks": 4}, "num_hops=5"),
    ("vt", "4hop", {"num_hops": 4, "num_chunks": 4}, "num_hops=4 needs 5"),
    ("vt", "kv-split", {"num_keys": 8, "num_chunks": 8}, "num_keys=8 needs 9"),
    ("pr", None, {"num_chunks": 0}, "num_chunks must be >= 1"),
    ("mv", None, {"needles": 3}, "unknown knob"),
    ("mv", None, {"num_values": "4"}, "num_values must be an integer"),
    ("msq", None, {"num_distractors": -1}, "num_distractors"),
    ("mix", None, {"num_chunks": 3}, "takes no knobs"),
])
def test_bad_knobs_are_named(corpus, task, variant, knobs, match):
    with pytest.raises(WorkloadError, match=match):
        generate(task, 0, variant, corpus, **knobs)


def test_sentence_splitter_keeps_abbreviations():
    text = "Dr. Smith went to Washington. He met Mr. Jones at 5 p.m. yesterday! Did it rain? Yes."
    assert split_sentences(text) == ["Dr. Smith went to Washington.", "He met Mr. Jones at 5 p.m. yesterday!",
                                     "Did it rain?", "Yes."]


def test_instance_json_round_trip_and_errors(corpus):
    inst = generate("msq", 1, None, corpus)
    import json
    assert WorkloadInstance.from_dict(json.loads(inst.to_json())) == inst
    with pytest.raises(Exception, match="line 3: missing field"):
        WorkloadInstance.from_dict({"documents": ["a"]}, where="line 3")
    with pytest.raises(Exception, match="documents must be a list"):
        WorkloadInstance.from_dict({"documents": "a", "question": "q", "gold": "g"})
    with pytest.raises(Exception, match="unknown field"):
        WorkloadInstance.from_dict({"documents": ["a"], "question": "q", "gold": "g", "colour": 1})


def test_corpus_files_missing_or_malformed_are_named(tmp_path, monkeypatch):
    with pytest.raises(corpus_mod.CorpusError, match="nope.jsonl"):
        corpus_mod.load_corpus_file(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "a", "text": "b"}\n{"title": "c"}\n')
    with pytest.raises(corpus_mod.CorpusError, match="bad.jsonl, line 2"):
        corpus_mod.load_corpus_file(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"title": "a", "text": "Some text.", "description": "d"}\n')
    assert corpus_mod.load_corpus_file(good).passages[0].description == "d"
    # a cached download that does not parse is named, with how to recover
    cached = tmp_path / "wiki.json"
    cached.write_text("{not json")
    monkeypatch.setattr(corpus_mod, "fetch_file", lambda *a: cached)
    corpus_mod.load_corpus.cache_clear()
    try:
        with pytest.raises(corpus_mod.CorpusError, match="wiki.json is malformed.*delete it"):
            corpus_mod.load_corpus()
    finally:
        corpus_mod.load_corpus.cache_clear()


def test_kv_split_cuts_each_statement_at_a_chunk_boundary(corpus):
    inst = generate("vt", 9, "kv-split", corpus)
    left, right = inst.metadata["evidence_chunks"]
    key = inst.question.split("number for ")[1].split(" mentioned")[0]
    assert right == left + 1
    assert inst.documents[left].endswith(f"One of the special magic numbers for {key} is:")
    assert inst.documents[right].startswith(f"{inst.gold[0]}. ")
    assert sum(d.endswith(" is:") for d in inst.documents) == 4


def test_defaults_are_the_calibrated_variants():
    assert {t: s.default_variant for t, s in TASKS.items()} == {
        "pr": "title", "msq": "1hop", "vt": "kv-split", "mv": "1-distractor"}
    assert {t: s.paper_variant for t, s in TASKS.items()} == {
        "pr": "description", "msq": "2hop", "vt": "4hop", "mv": "default"}


def test_pr_targets_are_balanced_over_positions(corpus):
    golds = [generate("pr", s, "title", corpus).gold[0] for s in range(40)]
    assert {g: golds.count(g) for g in set(golds)} == {f"Paragraph {i}": 10 for i in range(1, 5)}
    mix_golds = [generate("pr", s, "title", corpus).gold[0] for s in range(0, 160, 4)]
    assert len(set(mix_golds)) == 4 and max(mix_golds.count(g) for g in set(mix_golds)) == 10


def test_instances_are_identical_across_processes(tmp_path):
    """Determinism must not hang on Python's per-process string hashing (set order)."""
    import os
    import subprocess
    import sys
    code = ("from tests.workloads.test_tasks import _tiny_corpus; from cachesmith.workloads.tasks import TASKS, generate;"
            "print('|'.join(generate(t, 5, v, _tiny_corpus()).to_json() for t in TASKS for v in TASKS[t].variants))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and len(outs[0]) > 1000


def test_instance_json_keeps_single_turn_lines_and_digests_as_they_were():
    inst = generate("vt", 3)
    assert "history" not in json.loads(inst.to_json())  # outcome tables hold digests of these lines
    chat = replace(inst, history=(("user", "a"), ("assistant", "b")))
    assert WorkloadInstance.from_dict(json.loads(chat.to_json())) == chat
