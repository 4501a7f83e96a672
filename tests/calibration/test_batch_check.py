"""Batches timed on the serving path against the cost model, term by term; and the guard that the
packaged model's calibrated profile still prices the engine's batches."""
from __future__ import annotations

import random
import statistics

import pytest

from cachesmith.calibration.batch_check import (
    BETWEEN, STALL, CheckedBatch, check_batch, check_repeated, family, plan_family, repeat_spread, summary)
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.methods import parse_method
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchShape
from cachesmith.planner.cost_model import CostModel
from cachesmith.recompute import RecomputeConfig
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

GUARD_MAX_MEDIAN = 0.10  # loose enough for a noisy 2-core machine, tight enough to catch a model gone stale
GUARD_MAX_CALIBRATED = 0.35  # the start's calibration alone: a busy moment moves it by 10-20%


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path_factory.mktemp("tiny")), tmp_path_factory.mktemp("kv"))
    prompts = [pipe.stored_prompt(pipe.prompt(inst.documents, inst.question)) for inst in map(instance, range(4))]
    return pipe, prompts


def test_the_terms_add_up_to_the_measured_and_the_priced_ttft(tiny):
    pipe, prompts = tiny
    cost = CostModel(make_profile(num_layers=pipe.model.num_layers))
    for plan in (RecomputeConfig("kv_dev", 1, 1, 0.3), RecomputeConfig("qci", 0, 4, 0.15),
                 RecomputeConfig("position", 4, 0, 1.0)):
        batch = check_batch(pipe, cost, prompts[:2], plan)
        assert batch.shape.num_requests == 2 and batch.measured_s > 0
        assert sum(m for m, _ in batch.terms.values()) == pytest.approx(batch.measured_s, rel=1e-6)
        assert sum(p for _, p in batch.terms.values()) == pytest.approx(batch.predicted_s, rel=1e-6)
        assert BETWEEN in batch.terms and STALL in batch.terms
    assert set(check_batch(pipe, cost, prompts[:1], RecomputeConfig("kv_dev", 1, 1, 0.3)).terms) == {
        "full passes", "score_patch passes", "patch passes", BETWEEN, STALL}


def test_a_repeated_batch_is_priced_against_its_median_run(tiny):
    pipe, prompts = tiny
    cost = CostModel(make_profile(num_layers=pipe.model.num_layers))
    median_run, times = check_repeated(pipe, cost, prompts[:2], RecomputeConfig("kv_dev", 1, 1, 0.3), 5)
    assert len(times) == 5 and median_run.measured_s == statistics.median(times)
    assert median_run.predicted_s > 0 and median_run.shape.num_requests == 2
    with pytest.raises(ValueError, match="repeats=0"):
        check_repeated(pipe, cost, prompts[:1], RecomputeConfig("kv_dev", 1, 1, 0.3), 0)


def test_the_repeat_spread_is_each_runs_distance_from_its_batchs_median():
    assert repeat_spread([[1.0, 1.1, 0.9], [2.0, 2.0, 2.0]]) == pytest.approx(0.0)  # 3 of 6 at 0
    assert repeat_spread([[1.0, 1.1, 0.9], [2.0, 2.2, 1.8]]) == pytest.approx(0.1)


def test_families_are_named_as_the_replays_name_them():
    assert family("position", 30, 0) == "position/1/0"
    assert family("qci", 0, 30) == "qci/0/1"
    assert family("kv_dev", 1, 1) == "kv_dev/1/1"
    assert family("position", 0, 0) == "position/0/0"


def test_full_reuse_is_checked_as_a_family_of_its_own():
    """Feasibility prices every term at full reuse: its bias is read apart from EPIC's plan,
    which shares its signal and depths but recomputes rows."""
    from cachesmith.recompute.config import epic, full_reuse
    assert plan_family(full_reuse()) == "full_reuse"
    assert plan_family(epic(0.15)) == "position/0/0"
    assert plan_family(RecomputeConfig("qci", 0, 30, 0.0)) == "qci/0/1"  # its probe still runs


def test_the_summary_names_the_term_that_moves_a_family_most():
    shape = BatchShape((100,), (8,), (0,))
    batches = [CheckedBatch("kv_dev/1/1", "p", shape, 1.0, 1.0 + d, {"patch passes": (0.6, 0.6 + d),
                                                                     BETWEEN: (0.4, 0.4)})
               for d in (-0.2, -0.1, 0.05)]
    (row,) = summary(batches, min_batches=3)
    assert row["worst_term"] == "patch passes" and row["worst_term_share"] == pytest.approx(-0.1)
    assert row["median_abs_rel_err"] == pytest.approx(0.1) and row["median_rel_err"] == pytest.approx(-0.1)
    assert row["is_counted"] is True


@pytest.mark.slow  # calibrates, then times served batches on the packaged model
def test_the_calibrated_packaged_profile_prices_served_batches_within_the_guard(tmp_path):
    """A handful of batches of the workload's prompts on the packaged model, priced by the profile a
    server plans with (the packaged one calibrated to this machine at start). Each is judged at the
    pace learned from the others, as the planner prices a batch at the pace it learned from those
    before: what is left is whether the cost model describes the engine's shapes and plans, not how
    busy the machine was during the start's probes. The calibrated price alone must not be far off
    either."""
    from cachesmith.bench import BenchConfig
    from cachesmith.bench.setting import instances
    from cachesmith.calibration.packaged import serving_profile
    from cachesmith.workloads.prompts import instance_prompt

    pipe = RagPipeline("smollm2-135m", store=ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path)))
    profile, source = serving_profile(pipe)
    assert source.startswith("packaged")
    config = BenchConfig("mix", None, None, 6, "poisson", 1.0, 1.0, (2.0,), ("cachesmith",), "task", 5)
    prompts = [pipe.stored_prompt(instance_prompt(pipe, inst)) for inst in instances(config)]
    L, rng, cost = pipe.model.num_layers, random.Random(0), CostModel(profile)
    plans = [parse_method(m).plan(L) for m in ("cacheblend@0.15", "epic@0.15", "fusionrag@0.15")]
    plans.append(RecomputeConfig("kv_dev", 1, 1, 0.3))
    batches = [check_batch(pipe, cost, rng.sample(prompts, size), plan) for size in (1, 2) for plan in plans]
    paces = [b.measured_s / b.predicted_s for b in batches]
    paced = [statistics.median(paces[:i] + paces[i + 1:]) / pace - 1 for i, pace in enumerate(paces)]
    assert statistics.median(abs(e) for e in paced) <= GUARD_MAX_MEDIAN, paced
    assert statistics.median(abs(b.rel_err) for b in batches) <= GUARD_MAX_CALIBRATED, [b.rel_err for b in batches]
