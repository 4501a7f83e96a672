"""The serving loop end to end on a tiny random-weight model (replay clock, synthetic profile)."""
from __future__ import annotations

import math

import pytest

from cachesmith.bench.setting import instance_request
from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import ConfigError, InputError
from cachesmith.recompute import parse_label, preset
from cachesmith.request import Request
from cachesmith.scheduler import SchedulerConfig
from cachesmith.shadow_work import ShadowConfig
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # borrows the packaged model's tokenizer


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    return tiny_pipeline(model_dir, tmp_path_factory.mktemp("kv"))


@pytest.fixture(scope="module")
def profile(pipe):
    return make_profile(num_layers=pipe.model.num_layers)


def engine(pipe, profile, method="cachesmith", **sched):
    return Engine(pipe, profile, EngineConfig(method, "replay", scheduler=SchedulerConfig(**sched)))


def request(pipe, request_id, inst, slo_s, arrival_s=0.0):
    return instance_request(pipe, request_id, inst, slo_s, arrival_s)


def trace(pipe, n=8, slo=5.0, gap=0.05):
    return [request(pipe, i, instance(i), slo, i * gap) for i in range(n)]


def test_full_prefill_replay_answers_exactly_like_the_pipeline(pipe, profile):
    eng = engine(pipe, profile, "full_prefill", max_batch_size=3)
    results = eng.run(trace(pipe, 6))
    plan = preset("full_prefill", 1.0, pipe.model.num_layers)
    for res, inst in zip(results, [instance(i) for i in range(6)]):
        ref = pipe.answer(inst.documents, inst.question, plan, inst.max_new_tokens)
        assert res.error is None and res.answer == ref.text, res.request_id
        assert res.num_recomputed == res.num_context_tokens == ref.num_context_tokens
    assert max(r.batch_size for r in results) <= 3 and eng.stats.num_batches >= 2


def test_replay_clock_times_are_consistent(pipe, profile):
    eng = engine(pipe, profile, max_batch_size=4)
    results = eng.run(trace(pipe, 8, gap=0.02))
    by_batch = {}
    for r in results:
        assert r.error is None and r.first_token_s > r.arrival_s and r.ttft_s > 0
        by_batch.setdefault(r.batch_id, set()).add(r.first_token_s)
    assert all(len(t) == 1 for t in by_batch.values())  # lock-step: a batch's first tokens together
    ends = [min(by_batch[b]) for b in sorted(by_batch)]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    # the clock only moved by batch times and decisions (and idle gaps to arrivals)
    assert eng.clock.now() >= eng.stats.busy_s
    assert eng.clock.now() == pytest.approx(max(r.first_token_s for r in results))
    assert len(eng.stats.decision_ms) == eng.stats.num_batches and all(d > 0 for d in eng.stats.decision_ms)


def test_planned_batches_recompute_within_the_band(pipe, profile):
    results = engine(pipe, profile).run(trace(pipe, 4, slo=100.0, gap=10.0))
    for r in results:
        assert r.mode == "planned" and 0.05 <= r.coverage <= 1.0
        assert 0 < r.num_recomputed <= math.ceil(r.coverage * r.num_context_tokens) + 1


def test_requests_past_saving_run_at_full_reuse(pipe, profile):
    reqs = [request(pipe, 0, instance(0), 100.0), request(pipe, 1, instance(1), 1e-6)]
    results = engine(pipe, profile).run(reqs)
    assert results[1].mode == "full_reuse" and results[1].plan.startswith("(position,0,0")
    assert results[1].planned_s is None  # no planner priced it
    assert results[0].mode == "planned" and results[0].is_on_time


def test_a_bad_slo_or_a_prompt_past_the_model_is_refused_where_the_request_is_made(pipe):
    for slo, shown in ((0.0, "0.0"), (-2.0, "-2.0"), (float("nan"), "nan"), (True, "True")):
        with pytest.raises(InputError, match=f"request 3: slo_s={shown}: must be a positive number"):
            request(pipe, 3, instance(0), slo)
    big = instance(9, num_docs=12, words_per_doc=120)
    with pytest.raises(InputError, match="request 3: the prompt's .* exceed the model's"):
        request(pipe, 3, big, 5.0)


def test_a_request_past_a_limit_gets_its_own_error_and_the_run_goes_on(pipe, profile):
    big = instance(9, num_docs=6, words_per_doc=120)
    reqs = [request(pipe, 3, big, 5.0), request(pipe, 4, instance(4), 5.0, 0.1), Request(5, None, 5.0)]
    results = engine(pipe, profile, kv_capacity_tokens=600).run(reqs)
    assert "KV capacity of 600 tokens" in results[0].error
    assert results[1].error is None and results[1].answer is not None and results[1].first_token_s is not None
    assert "request 5: no stored prompt" in results[2].error


def test_unknown_method_and_clock_are_named():
    with pytest.raises(ConfigError, match="method='cacheblend'"):
        EngineConfig("cacheblend")
    with pytest.raises(ConfigError, match="clock='wall'"):
        EngineConfig(clock="wall")


def test_a_learning_engine_runs_the_shadow_work_it_is_handed(pipe, profile):
    """The engine imports no profiler: a learning method's shadow work comes in through its config."""
    with pytest.raises(ConfigError, match="shadow_work="):
        Engine(pipe, profile, EngineConfig("cachesmith+learn"))
    assert Engine(pipe, profile, EngineConfig("cachesmith+learn", shadow=ShadowConfig(fraction=0.0))).shadow is None
    built = []

    def shadow_work(pipeline, planner, config):
        built.append((pipeline, planner, config))
        return "the calibrator"

    config = EngineConfig("cachesmith+learn", shadow_work=shadow_work)
    eng = Engine(pipe, profile, config)
    assert eng.shadow == "the calibrator" and built == [(pipe, eng.planner, config.shadow)]
    assert Engine(pipe, profile, EngineConfig("cachesmith", shadow_work=shadow_work)).shadow is None  # learns nothing


def test_chunks_given_as_stored_ids_answer_like_their_texts(pipe, profile):
    from dataclasses import replace

    inst = instance(5)
    keys = tuple(pipe.store.ensure(pipe.model, pipe.tokenizer.chunk_ids(d))[0] for d in inst.documents)
    by_id = replace(inst, documents=(), chunk_ids=keys)
    unknown = replace(inst, documents=(), chunk_ids=(keys[0], "0" * len(keys[0])))
    reqs = [request(pipe, 0, inst, 50.0), request(pipe, 1, by_id, 50.0, 0.01)]
    results = engine(pipe, profile, "full_prefill", max_batch_size=1).run(reqs)
    assert results[0].error is None and results[1].error is None
    assert results[1].answer == results[0].answer and results[1].num_context_tokens == results[0].num_context_tokens
    assert reqs[1].prompt.chunk_keys == keys  # the stored chunks are run by the keys they were given
    with pytest.raises(InputError, match=r"chunk_ids\[1\].*unknown chunk id"):
        request(pipe, 2, unknown, 50.0)


def test_the_engine_is_exported_at_the_top_level():
    import cachesmith

    assert cachesmith.Engine is Engine and cachesmith.Request is Request
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        cachesmith.Engin


def test_live_clock_serves_arrivals_in_real_time(pipe, profile):
    from cachesmith.clock import LiveClock

    eng = Engine(pipe, profile, EngineConfig("cacheblend@0.3", "live"), clock=LiveClock())
    results = eng.run([request(pipe, 0, instance(0), 30.0), request(pipe, 1, instance(1), 30.0, 0.3)])
    assert all(r.error is None and r.is_on_time for r in results)
    assert results[1].first_token_s >= 0.3 and results[1].batch_id == 1  # it arrived after batch 0 began
    assert eng.clock.now() >= results[1].first_token_s


def test_runtime_monitor_is_wired_into_the_real_executor(pipe, profile):
    """A profile that promises a machine 10^4 x faster than this one: the monitor joins the layer
    hooks of the real runner, sees each planned batch run late, lowers the coverage of the layers
    still to run, and the planner learns the pace (measured / predicted) for the next plans."""
    from cachesmith.calibration.packaged import rescaled

    from dataclasses import replace

    # its link 10^4 x faster too: a cut saves compute only where the reused rows' loads do not
    # take longer than it (the monitor does not cut where lowering coverage saves nothing)
    fast = rescaled(profile, 1e-4)
    fast = replace(fast, tier_gbps={tier: 1e4 * gbps for tier, gbps in fast.tier_gbps.items()})
    eng = Engine(pipe, fast, EngineConfig("cachesmith:kv_dev", "replay"))
    # an SLO of 1 ms: a budget the promised machine meets and no real batch does (~10 ms here)
    results = eng.run([request(pipe, i, instance(i), 1e-3, 10.0 * i) for i in range(2)])
    assert all(r.error is None and r.mode == "planned" for r in results)
    assert eng.stats.num_monitor_replans >= 1
    # each record keeps the planner's price of its batch (what the promised machine would take) and
    # its batch's re-plans: the price is below what the batch took, the re-plans add up to the run's
    assert all(r.planned_s is not None and 0 < r.planned_s < r.batch_s for r in results)
    by_batch = {r.batch_id: r.num_replans for r in results}
    assert sum(by_batch.values()) == eng.stats.num_monitor_replans
    lowered = [r for r in results if r.num_recomputed < math.floor(r.coverage * r.num_context_tokens)]
    assert lowered, [(r.coverage, r.num_recomputed, r.num_context_tokens) for r in results]
    assert eng.planner.correction["kv_dev"] > 1.0  # learned: this machine is slower than promised
    # ... for the kind of batch that ran (its plan family and size class), which the next plan of
    # that kind reads; a kind never run reads the signal's pace
    plans = {(r.plan, r.num_prompt_tokens) for r in results}
    assert len(plans) >= 1
    for plan_label, num_tokens in plans:
        probe = parse_label(plan_label)[2]
        assert eng.planner.pace("kv_dev", probe, num_tokens) > 1.0
    # nothing of QCI ran: it reads the machine's pace over every batch, learned from kv_dev's
    assert eng.planner.pace("qci", 1, 1000) > 1.0
    # the executor measured each planned batch's tail (last layer to first tokens), which the next
    # batches' monitors keep clear of their limit
    tails, batch_s = list(eng.executor.tails_s), {r.batch_id: r.batch_s for r in results}
    assert len(tails) == len(batch_s)  # in batch order: each inside its own batch's measured time
    assert all(0 < t < batch_s[b] for t, b in zip(tails, sorted(batch_s)))
