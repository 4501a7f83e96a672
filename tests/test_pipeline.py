"""The Python API and the CLI on the packaged model: thin layers over the runner."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from cachesmith import cli
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model import greedy_decode
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import ProfileError
from cachesmith.recompute import BatchRunner, RecomputeRequest, full_prefill, parse_label, preset
from cachesmith.scheduler import QueuedRequest, SloAwareScheduler
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

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


# planned answers (no plan given) on a tiny random-weight model planned with a synthetic profile

TINY = instance(0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    pipe = tiny_pipeline(tiny_dir, tmp_path_factory.mktemp("kv-tiny"))
    pipe.use_profile(make_profile(num_layers=pipe.model.num_layers), "synthetic")
    return pipe


def tiny_answer(pipe, plan=None, slo_s=5.0):
    return pipe.answer(TINY.documents, TINY.question, plan, max_new_tokens=4, slo_s=slo_s)


def mid_band_slo(pipe) -> float:
    """An SLO whose budget (the scheduler aims 8% early) falls inside the request's budget band."""
    parts = pipe.prompt(TINY.documents, TINY.question)
    queued = QueuedRequest(0, 0.0, 1.0, sum(len(c) for c in parts.chunk_ids), len(parts.suffix_ids),
                           len(parts.prefix_ids))
    floor, saturation = SloAwareScheduler(pipe.one_planner().planner).band([queued])
    assert 0 < floor < saturation
    return (floor + saturation) / 2 / (1 - 0.08)


def test_planned_answer_runs_and_names_the_plan_chosen_in_the_band(tiny):
    slo_s = mid_band_slo(tiny)
    chosen = tiny.one_planner().plan(tiny.prompt(TINY.documents, TINY.question), slo_s)
    assert chosen.mode == "planned" and chosen.planned_s <= chosen.budget_s < slo_s
    ans = tiny_answer(tiny, slo_s=slo_s)
    signal, _, _, coverage = parse_label(ans.plan)
    assert ans.plan == chosen.config.label() and signal in ("kv_dev", "qci", "qci_last")
    assert 0.05 <= coverage < 1.0 and ans.planned_s == pytest.approx(chosen.planned_s)
    given = tiny_answer(tiny, chosen.config)  # the same plan, given: the same answer, no planner's price
    assert (given.token_ids, given.num_recomputed) == (ans.token_ids, ans.num_recomputed)
    assert given.planned_s is None and 0 < ans.num_recomputed < ans.num_context_tokens


def test_planned_answer_with_a_generous_slo_recomputes_all_and_answers_like_full_prefill(pipe):
    # the real model (the tiny random one answers the same whatever runs); costs from a synthetic profile
    pipe.use_profile(make_profile(num_layers=pipe.model.num_layers), "synthetic")
    question = "Describe each of the three passages in one sentence each."  # open: a long answer tells plans apart
    ans = pipe.answer(DOCS, question, None, 32, slo_s=3600.0)
    assert parse_label(ans.plan)[3] == 1.0  # past saturation the budget buys coverage up to 100%
    assert ans.num_recomputed == ans.num_context_tokens and ans.planned_s < 3600.0
    full = pipe.answer(DOCS, question, full_prefill(pipe.model.num_layers), 32)
    assert ans.token_ids == full.token_ids
    assert pipe.answer(DOCS, question, preset("full_reuse", 0.0, 30), 32).token_ids != full.token_ids  # it can tell


def test_planned_answer_past_saving_runs_full_reuse(tiny):
    ans = tiny_answer(tiny, slo_s=1e-6)  # even the band's floor misses it: as the engine, full reuse
    assert ans.plan.startswith("(position,0,0,") and ans.planned_s is not None


def test_planned_answer_refuses_a_bad_slo(tiny):
    for slo_s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InputError, match="slo_s="):
            tiny_answer(tiny, slo_s=slo_s)


def test_profile_is_loaded_on_the_first_planned_answer_only(tiny_dir, tmp_path):
    missing = tmp_path / "no-profile.json"
    pipe = RagPipeline(str(tiny_dir), store=ChunkStore(StoreConfig(tiers=("memory",))), profile_path=missing)
    plan = full_prefill(pipe.model.num_layers)
    assert tiny_answer(pipe, plan).plan == plan.label()  # a fixed plan never loads the profile
    with pytest.raises(ProfileError, match="no-profile.json"):
        tiny_answer(pipe)
    path = tmp_path / "tiny-profile.json"
    replace(make_profile(num_layers=pipe.model.num_layers), model_fingerprint=pipe.model.fingerprint).save(path)
    pipe.profile_path = path
    planner = pipe.one_planner()
    assert planner.source == f"given ({path})" and pipe.one_planner() is planner  # loaded once, kept


def test_cli_ask_plans_with_the_planner_by_default(tiny, tiny_dir, tmp_path, capsys):
    docs = []
    for i, doc in enumerate(TINY.documents):
        (tmp_path / f"d{i}.txt").write_text(doc)
        docs += ["--doc", str(tmp_path / f"d{i}.txt")]
    path = tmp_path / "tiny-profile.json"
    replace(make_profile(num_layers=tiny.model.num_layers), model_fingerprint=tiny.model.fingerprint).save(path)
    base = ["ask", "--model", str(tiny_dir), *docs, "--question", TINY.question, "--max-new-tokens", "3"]
    assert cli.main([*base, "--profile", str(path)]) == 0  # the default method plans
    err = capsys.readouterr().err
    assert f"profile: given ({path})" in err
    assert re.search(r"\[cachesmith \((kv_dev|qci|qci_last),\d+,\d+,\d+%\) for SLO 5000 ms, planned [0-9.]+ s: "
                     r"recomputed \d+/\d+ context tokens, TTFT [0-9.]+ s\]", err), err
    assert cli.main([*base, "--method", "cachesmith", "--slo-ms", "3600000", "--profile", str(path)]) == 0
    assert re.search(r",100%\) for SLO 3600000 ms", capsys.readouterr().err)
    assert cli.main([*base, "--method", "cacheblend@0.15"]) == 0  # a fixed plan: no profile, no planner
    err = capsys.readouterr().err
    assert "[(kv_dev,1,0,15%): recomputed" in err and "profile:" not in err


def test_cli_ask_refuses_what_a_lone_request_cannot_use(tiny_dir, tmp_path, capsys):
    (tmp_path / "d.txt").write_text("A short text.")
    base = ["ask", "--model", str(tiny_dir), "--doc", str(tmp_path / "d.txt"), "--question", "q"]
    assert cli.main([*base, "--method", "full_prefill", "--slo-ms", "100"]) == 2
    assert "--slo-ms applies to --method cachesmith only" in capsys.readouterr().err
    assert cli.main([*base, "--method", "cachesmith+task"]) == 2
    assert "ask answers one request alone" in capsys.readouterr().err
    assert cli.main([*base, "--slo-ms", "0"]) == 2
    assert "--slo-ms 0.0: must be a positive" in capsys.readouterr().err
    assert cli.main([*base, "--method", "cacheblend@2"]) == 2
    assert "coverage 2.0 must be in (0, 1]" in capsys.readouterr().err
    assert cli.main([*base, "--method", "cacheblend", "--coverage", "2"]) == 2  # the older spelling
    assert "--coverage=2.0 must be a fraction in [0, 1]" in capsys.readouterr().err


def test_cli_ask_plans_with_the_serving_profile(tmp_path, capsys):
    (tmp_path / "d.txt").write_text(DOCS[1])
    assert cli.main(["ask", "--doc", str(tmp_path / "d.txt"), "--question", QUESTION, "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    # this machine's measured profile, else the packaged one calibrated to it (as `serve` does)
    assert re.search(r"profile: (measured|packaged \(speed factor [0-9.]+, reuse [0-9.]+\))\n", err), err
    assert "[cachesmith (" in err and "for SLO 5000 ms" in err
