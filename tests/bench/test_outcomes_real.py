"""Outcome tables on the packaged model: the simulator's verdict for a plan equals the one the real
engine gives the same instance under that plan."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cachesmith.bench.outcomes import OutcomeMeasurer, OutcomeTable, append_table, extend_table
from cachesmith.bench.setting import instance_request
from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Profile
from cachesmith.calibration.packaged import PACKAGED_DIR
from cachesmith.calibration.verdicts import Verdicts
from cachesmith.profiler.subjects import instance_subject
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.scoring import score
from cachesmith.workloads.card import answer_instance
from cachesmith.workloads.tasks import generate

pytestmark = pytest.mark.real_model


def test_table_verdicts_match_the_engine_on_the_packaged_model(tmp_path):
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    inst = generate("pr", 4)
    measurer = OutcomeMeasurer(pipe, tmp_path / "evals.jsonl")
    o = measurer.measure(inst, 4)
    assert o.task == "pr" and o.context_tokens > 100 and 0.0 <= o.entropy <= 1.0
    assert set(o.flips) == {f"{s}/{d}" for s in ("kv_dev", "qci") for d in (2, 6, 15)}
    L = pipe.model.num_layers
    num_evals = len((tmp_path / "evals.jsonl").read_text().splitlines())
    assert measurer.measure(inst, 4) == o  # resumed from the cache: nothing evaluated again
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == num_evals
    flips_only = measurer.measure(inst, 4, is_flips_only=True)  # demand instances: no presets, same flips
    shallow = {RecomputeConfig("kv_dev", 1, 0, c).label() for c in (0.05, 0.10)}  # CacheBlend below 15%
    assert shallow <= set(o.plans)
    assert flips_only.flips == o.flips and set(flips_only.plans) == {
        preset("full_prefill", 1.0, L).label(), preset("full_reuse", 0.0, L).label(),
        preset("cacheblend", 0.15, L).label(), preset("cacheblend", 0.3, L).label()} | shallow | {
        RecomputeConfig(s, 1, L - 1, c).label() for s in ("qci_last", "fused")
        for c in (0.05, 0.10, 0.15, 0.30)}  # the fixed-split families
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == num_evals
    # a table measured before the plan list grew: extending it measures exactly what it lacks
    older = replace(o, plans={k: v for k, v in o.plans.items() if k not in shallow})
    table = OutcomeTable("smollm2-135m", L, pipe.model.config.max_positions, [older])
    assert extend_table(pipe, table, tmp_path / "evals.jsonl", show_progress=False) == 2
    assert table.outcomes[0].plans == o.plans and table.outcomes[0].static == o.static
    assert extend_table(pipe, table, tmp_path / "evals.jsonl", show_progress=False) == 0
    lacking = {k: v for k, v in o.plans.items() if k not in shallow}
    stale = OutcomeTable("smollm2-135m", L, 2048, [replace(o, plans=lacking, digest="0" * 16)])
    with pytest.raises(InputError, match="no longer generates"):
        extend_table(pipe, stale, tmp_path / "evals.jsonl", show_progress=False)
    profile = Profile.load(PACKAGED_DIR / "smollm2-135m-float32-cpu.json")
    for method in ("full_prefill", "cacheblend@0.15", "prophetkv@0.3"):
        engine = Engine(pipe, profile, EngineConfig(method))
        (res,) = engine.run([instance_request(pipe, 0, inst, 60.0)])
        plan = engine.method.plan(L)
        assert res.is_passed == o.plans[plan.label()], method


@pytest.mark.slow  # forks and batches every plan on the packaged model
def test_forked_batched_verdicts_equal_the_serving_path_and_tables_grow_by_append(tmp_path):
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    inst = generate("pr", 20)  # its verdict flips at 55% (qci/6) and 70% (kv_dev/2) in the packaged table
    plans = [RecomputeConfig("qci", 5, 1, 0.2), RecomputeConfig("qci", 5, 1, 0.55), RecomputeConfig("kv_dev", 1, 0, 0.1),
             RecomputeConfig("kv_dev", 1, 1, 0.35), RecomputeConfig("kv_dev", 1, 1, 0.7), preset("epic", 0.15, 30)]
    records = Verdicts(pipe, tmp_path / "v.jsonl").measure(instance_subject(pipe, inst), [(p, p.label()) for p in plans])
    for plan, rec in zip(plans, records):  # one fork per (S, w, p), all six decoded together
        ans = answer_instance(pipe, inst, plan)  # staged, alone: what serving runs
        assert (rec["text"], rec["entropy"]) == (ans.text, ans.qci_entropy), plan.label()
        assert rec["passed"] == score(inst, ans.text).passed
    assert {r["passed"] for r in records} == {True, False}  # the plans really differ
    path = tmp_path / "t.json"
    OutcomeTable("smollm2-135m", 30, pipe.model.config.max_positions, []).save(path)
    pr = [(8, generate("pr", 8)), (12, generate("pr", 12))]
    assert append_table(pipe, path, pr[:1], tmp_path / "e.jsonl", show_progress=False) == 1
    assert append_table(pipe, path, pr, tmp_path / "e.jsonl", show_progress=False) == 1  # skips what it holds
    assert [(o.task, o.seed) for o in OutcomeTable.load(path).outcomes] == [("pr", 8), ("pr", 12)]
