"""`run_bench` end to end on a tiny model: a workload file with a bad line, two methods, resume."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cachesmith.bench import KEYS, BenchConfig, markdown, plot, run_bench
from cachesmith.bench import run as bench_run
from cachesmith.errors import ConfigError
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile
from cachesmith.workloads.prompts import instance_prompt

pytestmark = pytest.mark.real_model  # borrows the packaged model's tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    pipe = tiny_pipeline(save_tiny_chat_model(root / "model"), root / "kv")
    prof = replace(make_profile(num_layers=pipe.model.num_layers), model_fingerprint=pipe.model.fingerprint)
    prof.save(root / "profile.json")
    lines = [instance(i).to_json() for i in range(5)]
    lines.insert(2, json.dumps({"documents": [], "question": "q?", "gold": ["a"]}))
    (root / "work.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return pipe, root


def test_bench_writes_summary_records_and_resumes(setup, monkeypatch):
    pipe, root = setup
    config = BenchConfig(workload_file=str(root / "work.jsonl"), num_requests=6, utilization=0.5,
                         slo_scales=(1.0, 3.0), methods=("cachesmith", "full_prefill", "epic@0.3"), num_base_samples=2)
    out = root / "out"
    result = run_bench(pipe, config, out, root / "profile.json", show_progress=False)
    assert result.profile_source == "measured" and result.base_slo_s > 0
    rows = [r for r in result.rows if r["method"] != "best_static"]
    assert len(rows) == 6 and all(set(KEYS) <= set(r) for r in rows)
    bad = [r for r in result.records if r["error"]]
    assert len(bad) == 6 and all("line 3" in r["error"] and "documents" in r["error"] for r in bad)  # 1 per run
    assert all(r["num_errors"] == 1 and r["num_requests"] == 6 for r in rows)
    best = [r for r in result.rows if r["method"] == "best_static"]
    assert [b["slo_scale"] for b in best] == [1.0, 3.0]
    for b in best:
        static = [r["qsa"] for r in rows if r["slo_scale"] == b["slo_scale"] and r["method"] != "cachesmith"]
        assert b["qsa"] == max(static)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(result.rows)) and len(saved["records"]) == 36
    assert "| cachesmith |" in markdown(result) and plot(result, out / "qsa.png").stat().st_size > 10_000
    # a second call resumes from the saved runs: nothing is served again
    monkeypatch.setattr(bench_run.Engine, "run", lambda *a, **k: pytest.fail("a finished run was served again"))
    again = run_bench(pipe, config, out, root / "profile.json", show_progress=False)
    assert again.rows == result.rows


@pytest.mark.parametrize("kwargs, match", [({"methods": ("warp@0.1",)}, "warp"), ({"slo_scales": ()}, "slo_scales"),
                                           ({"pattern": "poisson", "cv": 3.0}, "use pattern='gamma'"),
                                           ({"task": "file"}, "needs workload_file"),
                                           ({"utilization": 0}, "utilization=0")])
def test_bad_bench_configs_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BenchConfig(**kwargs)


def test_a_given_base_slo_with_a_measured_profile_measures_nothing(setup, monkeypatch):
    pipe, root = setup
    monkeypatch.setattr(bench_run, "measure_base", lambda *a: pytest.fail("the base SLO was given"))
    config = BenchConfig(workload_file=str(root / "work.jsonl"), num_requests=3, methods=("full_reuse",),
                         base_slo_s=1.5)
    result = run_bench(pipe, config, root / "given", root / "profile.json", show_progress=False)
    assert result.base_slo_s == 1.5 and result.speed_factor == 1.0
    assert {r["slo_s"] for r in result.records} == {1.5 * 2.0}


def test_a_packaged_profile_is_rescaled_by_both_measured_factors(setup, monkeypatch):
    pipe, root = setup
    prof = make_profile(num_layers=pipe.model.num_layers)
    monkeypatch.setattr(bench_run, "find_profile", lambda *a: (prof, "packaged"))
    config = BenchConfig(workload_file=str(root / "work.jsonl"), num_requests=3, methods=("full_reuse",),
                         num_base_samples=2)
    out = root / "packaged"
    result = run_bench(pipe, config, out, show_progress=False)
    saved = json.loads((out / "base.json").read_text())
    probes = saved["reuse_probes"]
    assert len(probes) == 2 and all(0 < p["coverage"] <= 1 and p["seconds"] > 0 for p in probes)
    assert result.reuse_factor == bench_run.reuse_factor(prof, probes) > 0
    # a base.json from before the reuse probe: the speed factor serves for both, nothing is re-measured
    del saved["reuse_probes"]
    (out / "base.json").write_text(json.dumps(saved))
    for name in ("measure_base", "reuse_probes"):
        monkeypatch.setattr(bench_run, name, lambda *a: pytest.fail("the base was measured again"))
    (out / "summary.json").unlink()
    again = run_bench(pipe, config, out, show_progress=False)
    assert again.reuse_factor is None and again.speed_factor == result.speed_factor  # None: the speed factor's


def test_reuse_probes_read_their_chunks_from_the_slower_tier(tmp_path):
    # a replay reads most chunks from disk (the memory tier holds few requests); probes reading the
    # chunks just stored would time memory reads and under-price serving
    from cachesmith.kvstore.store import ChunkStore, StoreConfig

    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path / "m"), tmp_path / "kv")
    pipe.store = pipe.transfer.store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path / "kv"))
    insts = [instance(0), instance(1)]
    for inst in insts:  # stored, so hot in memory, as after the base SLO's prefills
        pipe.stored_prompt(instance_prompt(pipe, inst))
    probes = bench_run.reuse_probes(pipe, insts)
    assert len(probes) == 2 and all(p["seconds"] > 0 for p in probes)
    num_chunks = sum(len(instance_prompt(pipe, i).chunk_ids) for i in insts)
    assert pipe.store.stats.hits["disk"] >= num_chunks
    # a memory-only store has nowhere slower to read from: nothing is dropped
    mem = tiny_pipeline(save_tiny_chat_model(tmp_path / "m2"), tmp_path / "kv2")
    assert len(bench_run.reuse_probes(mem, insts)) == 2 and mem.store.stats.hits["disk"] == 0
