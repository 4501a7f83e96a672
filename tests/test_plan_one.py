"""Planned answers (`plan_one`): one request planned alone under its SLO, as the server would on an
idle machine, and answered by the pipeline under that plan; `cachesmith ask` over it. On a tiny
random-weight model planned with a synthetic profile, and on the packaged model."""
from __future__ import annotations

import gc
import re
from dataclasses import replace

import pytest

from cachesmith import cli, plan_one
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.plan_one import DEFAULT_SLO_S, OnePlanner, one_planner, use_profile
from cachesmith.planner import ProfileError
from cachesmith.recompute import full_prefill, parse_label, preset
from cachesmith.scheduler import QueuedRequest, SloAwareScheduler
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile
from tests.test_pipeline import DOCS, QUESTION  # the same passages and question as the pipeline's tests

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

TINY = instance(0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    return tiny_pipeline(tiny_dir, tmp_path_factory.mktemp("kv-tiny"))


@pytest.fixture(scope="module")
def planner(tiny):
    return OnePlanner.of(make_profile(num_layers=tiny.model.num_layers), "synthetic")


def tiny_answer(pipe, planner, slo_s=DEFAULT_SLO_S):
    return planner.answer(pipe, TINY.documents, TINY.question, slo_s, max_new_tokens=4)


def mid_band_slo(pipe, planner) -> float:
    """An SLO whose budget (the scheduler aims 8% early) falls inside the request's budget band."""
    parts = pipe.prompt(TINY.documents, TINY.question)
    queued = QueuedRequest(0, 0.0, 1.0, sum(len(c) for c in parts.chunk_ids), len(parts.suffix_ids),
                           len(parts.prefix_ids))
    floor, saturation = SloAwareScheduler(planner.planner).band([queued])
    assert 0 < floor < saturation
    return (floor + saturation) / 2 / (1 - 0.08)


def test_planned_answer_runs_and_names_the_plan_chosen_in_the_band(tiny, planner):
    slo_s = mid_band_slo(tiny, planner)
    chosen = planner.plan(tiny.prompt(TINY.documents, TINY.question), slo_s)
    assert chosen.mode == "planned" and chosen.planned_s <= chosen.budget_s < slo_s
    ans = tiny_answer(tiny, planner, slo_s)
    signal, _, _, coverage = parse_label(ans.plan)
    assert ans.plan == chosen.config.label() and signal in ("kv_dev", "qci", "qci_last")
    assert 0.05 <= coverage < 1.0 and ans.planned_s == pytest.approx(chosen.planned_s)
    given = tiny.answer(TINY.documents, TINY.question, chosen.config, max_new_tokens=4)  # no planner's price
    assert (given.token_ids, given.num_recomputed) == (ans.token_ids, ans.num_recomputed)
    assert given.planned_s is None and 0 < ans.num_recomputed < ans.num_context_tokens


def test_planned_answer_with_a_generous_slo_recomputes_all_and_answers_like_full_prefill(tmp_path_factory):
    # the real model (the tiny random one answers the same whatever runs); costs from a synthetic profile
    pipe = RagPipeline("smollm2-135m", store=ChunkStore(StoreConfig(root=tmp_path_factory.mktemp("kv"))))
    planner = OnePlanner.of(make_profile(num_layers=pipe.model.num_layers), "synthetic")
    question = "Describe each of the three passages in one sentence each."  # open: a long answer tells plans apart
    ans = planner.answer(pipe, DOCS, question, 3600.0, 32)
    assert parse_label(ans.plan)[3] == 1.0  # past saturation the budget buys coverage up to 100%
    assert ans.num_recomputed == ans.num_context_tokens and ans.planned_s < 3600.0
    full = pipe.answer(DOCS, question, full_prefill(pipe.model.num_layers), 32)
    assert ans.token_ids == full.token_ids
    assert pipe.answer(DOCS, question, preset("full_reuse", 0.0, 30), 32).token_ids != full.token_ids  # it can tell


def test_planned_answer_past_saving_runs_full_reuse(tiny, planner):
    ans = tiny_answer(tiny, planner, slo_s=1e-6)  # even the band's floor misses it: as the engine, full reuse
    assert ans.plan.startswith("(position,0,0,") and ans.planned_s is not None


def test_planned_answer_refuses_a_bad_slo(tiny, planner):
    for slo_s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InputError, match="slo_s="):
            tiny_answer(tiny, planner, slo_s=slo_s)


def test_the_serving_profile_is_the_one_at_the_path_given(tiny, tmp_path):
    with pytest.raises(ProfileError, match="no-profile.json"):
        OnePlanner.for_pipeline(tiny, tmp_path / "no-profile.json")
    path = tmp_path / "tiny-profile.json"
    replace(make_profile(num_layers=tiny.model.num_layers), model_fingerprint=tiny.model.fingerprint).save(path)
    assert OnePlanner.for_pipeline(tiny, path).source == f"given ({path})"


def test_the_planner_kept_for_a_pipeline_is_built_once_and_goes_with_it(tiny_dir, tmp_path):
    """`one_planner` / `use_profile`: for callers that hold a pipeline but no planner."""
    path = tmp_path / "tiny-profile.json"
    pipe = RagPipeline(str(tiny_dir), store=ChunkStore(StoreConfig(tiers=("memory",))))
    replace(make_profile(num_layers=pipe.model.num_layers), model_fingerprint=pipe.model.fingerprint).save(path)
    kept = one_planner(pipe, path)
    assert kept.source == f"given ({path})" and one_planner(pipe) is kept  # loaded once, kept
    given = use_profile(pipe, make_profile(num_layers=pipe.model.num_layers), "synthetic")
    assert one_planner(pipe) is given and given.source == "synthetic"
    other = RagPipeline(str(tiny_dir), store=ChunkStore(StoreConfig(tiers=("memory",))))
    assert one_planner(other, path) is not given and one_planner(pipe) is given  # one per pipeline
    num_kept = len(plan_one._KEPT)
    del pipe, other
    gc.collect()
    assert len(plan_one._KEPT) == num_kept - 2  # weakly kept: a pipeline's planner goes with it


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
    assert re.search(r"profile: (measured|packaged \(speed factor [0-9.]+, reuse [0-9.]+, recomputed rows [0-9.]+\))\n",
                     err), err
    assert "[cachesmith (" in err and "for SLO 5000 ms" in err
