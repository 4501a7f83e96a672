"""The Python API and the CLI on the packaged model: thin layers over the runner. Planned answers
(no plan given) are `plan_one`'s: tests/test_plan_one.py."""
from __future__ import annotations

import pytest

from cachesmith import cli
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model import greedy_decode
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import BatchRunner, RecomputeRequest, preset

pytestmark = pytest.mark.real_model

DOCS = ["The lighthouse on the northern cape was built in 1871 from local granite.",
        "One of the special magic numbers for velvet-canyon is: 5176024.",
        "Glaciers carve valleys with steep walls and flat floors over many centuries."]
QUESTION = "What is the special magic number for velvet-canyon?"


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    store = ChunkStore(StoreConfig(root=tmp_path_factory.mktemp("kv")))
    return RagPipeline("smollm2-135m", store=store)


def test_full_prefill_plan_answers_like_plain_prefill(pipe):
    parts = pipe.prompt(DOCS, QUESTION, "The special magic number for velvet-canyon is:")
    logits, cache = pipe.model.prefill(parts.token_ids, extra_capacity=12)
    expected = pipe.tokenizer.decode(greedy_decode(pipe.model, logits, cache, 12)).strip()
    ans = pipe.answer(DOCS, QUESTION, preset("full_prefill", 1.0, 30), max_new_tokens=12,
                      answer_prefix="The special magic number for velvet-canyon is:")
    assert ans.text == expected and "5176024" in ans.text
    assert ans.num_recomputed == ans.num_context_tokens == sum(len(c) for c in parts.chunk_ids)
    assert ans.ttft_s > 0


def test_real_model_full_coverage_matches_full_prefill(pipe):
    parts = pipe.prompt(DOCS, QUESTION)
    ref, _ = pipe.model.prefill(parts.token_ids)
    req = RecomputeRequest([pipe.chunk(c) for c in parts.chunk_ids], parts.suffix_ids, pipe.chunk(parts.prefix_ids))
    for name in ("cacheblend", "prophetkv", "epic"):
        out = BatchRunner(pipe.model).run([req], preset(name, 1.0, 30))[0]
        assert (out.logits - ref).abs().max().item() < 1e-3
    reuse = BatchRunner(pipe.model).run([req], preset("full_reuse", 0.0, 30))[0]
    assert (reuse.logits - ref).abs().max().item() > 1e-2  # isolation really loses something


def test_precompute_counts_new_tokens_once(pipe):
    docs = [d + " (copy)" for d in DOCS]
    num_tokens, seconds = pipe.precompute(docs)
    assert num_tokens > 0 and seconds > 0
    assert pipe.precompute(docs)[0] == 0


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert cli.main(["ask", "--doc", str(tmp_path / "missing.txt"), "--question", "q"]) == 2
    assert "missing.txt" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    assert cli.main(["ask", "--doc", str(bad), "--question", "q"]) == 2
    assert "UTF-8" in capsys.readouterr().err
    assert cli.main(["models", "fetch", "no-such-model"]) == 2
    assert "unknown model name" in capsys.readouterr().err
    assert cli.main(["models", "list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_cli_ask_answers(tmp_path, capsys):
    paths = []
    for i, doc in enumerate(DOCS):
        paths += ["--doc", str(tmp_path / f"d{i}.txt")]
        (tmp_path / f"d{i}.txt").write_text(doc)
    assert cli.main(["ask", *paths, "--question", QUESTION + " Answer with the number only.",
                     "--method", "full_prefill", "--max-new-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert "5176024" in captured.out and "TTFT" in captured.err


def test_precompute_cli_is_resumable_and_reports(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('"The first passage of the corpus."\n{"text": "A second passage, as an object."}\n\n')
    args = ["precompute", str(corpus), "--store-root", str(tmp_path / "kv"), "--tiers", "disk"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "2 passages: 2 computed, 0 already stored" in out and "tokens/s" in out and "MB written" in out
    assert len(list((tmp_path / "kv").glob("*/*.cskv"))) == 2
    assert cli.main(args) == 0
    assert "0 computed, 2 already stored" in capsys.readouterr().out
    corpus.write_text('"fine"\n{"title": "no text"}\n')
    assert cli.main(args) == 2
    assert "corpus.jsonl:2" in capsys.readouterr().err


def test_the_pipeline_runs_a_given_plan_and_points_to_the_planner_without_one(pipe):
    with pytest.raises(InputError, match="plan=None.*OnePlanner.for_pipeline"):
        pipe.answer(DOCS, QUESTION, None)

