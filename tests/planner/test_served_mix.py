"""The served mix learned from verdicts (`planner.served_mix`): its posterior over "the profiled mix"
and "one task alone", the demand it prices plans with, and the planner's `cachesmith+learn` wiring."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.profile import NEVER, DemandCurve
from cachesmith.planner.served_mix import ServedMix, ServedMixConfig
from tests.planner.synthetic_profile import make_profile

DEPTHS = (2, 6, 15)


def curve(signal: str, depth: int, task: str | None, passing: int, num: int = 20) -> DemandCurve:
    """`passing` of `num` requests pass from 10% coverage on; the rest never do."""
    return DemandCurve(signal, depth, (0.1,) * passing + (NEVER,) * (num - passing), task)


def two_task_demand() -> tuple[DemandCurve, ...]:
    """"easy" passes with query-context ranking, rarely with KV deviation; "hard" the other way round.
    The mix (None) holds both tasks' requests, and favours query-context ranking."""
    out = []
    for depth in DEPTHS:
        for signal, easy, hard in (("kv_dev", 4, 14), ("qci", 20, 2)):
            out += [curve(signal, depth, "easy", easy), curve(signal, depth, "hard", hard),
                    DemandCurve(signal, depth, curve(signal, depth, None, easy).demands
                                + curve(signal, depth, None, hard).demands)]
    return tuple(out)


def test_without_verdicts_the_weights_are_the_profiled_shares_and_price_the_profiled_mix():
    demand = DemandModel(two_task_demand())
    mix = ServedMix(demand)
    assert mix.tasks == ["easy", "hard"] and np.allclose(mix.weights, [0.5, 0.5])
    for signal in ("kv_dev", "qci"):
        for depth in (2, 6, 15):
            assert np.allclose(mix.cdf(signal, depth), demand.cdf(signal, depth))  # the pooled curve


def test_verdicts_move_the_posterior_to_the_task_they_fit():
    mix = ServedMix(DemandModel(two_task_demand()))
    for _ in range(6):  # query-context ranking fails at 20%: "hard" does that, "easy" rarely
        mix.observe("qci", 6, 0.2, False)
    post = dict(zip(["mix", *mix.tasks], mix.posterior))
    assert post["hard"] > 0.9 and mix.weights[1] > 0.9 and mix.version > 0
    # the other signal is repriced by them: KV deviation's pass rate moves to hard's 14/20
    assert mix.pass_probability("kv_dev", 6, [0.2])[0] == pytest.approx(0.7, abs=0.03)
    assert mix.describe()["hard"] > 0.9


def test_a_stream_like_the_profiled_mix_keeps_the_mix():
    mix = ServedMix(DemandModel(two_task_demand()))
    rng = np.random.default_rng(0)
    for _ in range(100):  # half easy, half hard requests, verdicts drawn from their own rates
        rate = 20 / 20 if rng.random() < 0.5 else 2 / 20
        mix.observe("qci", 6, 0.2, bool(rng.random() < rate))
    assert mix.posterior[0] > 0.5  # the mixture hypothesis fits a mixed stream best
    assert 0.3 < mix.weights[0] < 0.7


def test_the_window_forgets_old_verdicts():
    mix = ServedMix(DemandModel(two_task_demand()), ServedMixConfig(max_observations=5))
    for _ in range(5):
        mix.observe("qci", 6, 0.2, False)  # hard
    assert mix.weights[1] > 0.9
    for _ in range(5):
        mix.observe("qci", 6, 0.2, True)  # easy, and the window holds only these now
    assert mix.weights[0] > 0.9 and mix.num_observed == 10


def test_verdicts_it_cannot_read_are_ignored():
    single = DemandModel(tuple(c for c in two_task_demand() if c.task in (None, "easy")))
    mix = ServedMix(single)  # one task: nothing to tell apart
    mix.observe("qci", 6, 0.2, False)
    assert not mix.is_active and mix.num_observed == 0
    mix = ServedMix(DemandModel(two_task_demand()))
    mix.observe("fused", 30, 0.2, False)  # a signal the profile has no curves of
    assert mix.num_observed == 0 and mix.version == 0


def test_small_moves_keep_the_version():
    mix = ServedMix(DemandModel(two_task_demand()), ServedMixConfig(min_change=0.5))
    mix.observe("qci", 6, 0.2, False)
    assert mix.version == 0 and np.allclose(mix.weights, [0.5, 0.5])  # moved, but under min_change


@pytest.mark.parametrize("field, value, words", [
    ("mix_prior", 1.0, "mix_prior=1.0"), ("max_observations", 0, "max_observations=0"),
    ("min_pass_probability", 0.5, "min_pass_probability=0.5"), ("min_change", 1.0, "min_change=1.0")])
def test_bad_config_names_the_field(field, value, words):
    with pytest.raises(ConfigError, match=words):
        ServedMixConfig(**{field: value})


def planner(**config) -> Planner:
    """The passes rule: the robust one would hold to KV deviation, which "hard" favours."""
    config.setdefault("signal_rule", "passes")
    return Planner(replace(make_profile(), demand=two_task_demand()), PlannerConfig(**config))


def test_the_learning_planner_follows_the_verdicts_to_the_signal_they_favour():
    reqs = [PlanRequest(1500, 30, 0, 0.9) for _ in range(2)]
    learning, fixed = planner(is_mix_learned=True), planner()
    budget = sum(learning.band(learning.shape(reqs), "kv_dev")) / 2
    assert learning.plan(reqs, budget).signal == fixed.plan(reqs, budget).signal == "qci"  # the mix: qci
    for _ in range(6):
        learning.observe_verdict("qci", 5, 1, 0.2, False)
        fixed.observe_verdict("qci", 5, 1, 0.2, False)  # not learning: no effect
    assert learning.plan(reqs, budget).signal == "kv_dev"  # the stream is "hard": qci fails it
    assert fixed.plan(reqs, budget).signal == "qci" and fixed.served_mix is None
    hinted = [replace(r, task="easy") for r in reqs]  # a task hint still wins over what was learned
    assert planner(is_mix_learned=True).plan(hinted, budget).task == "easy"


def test_learned_plans_price_passes_with_the_learned_demand():
    reqs = [PlanRequest(1500, 30, 0, 0.9)]
    p = planner(is_mix_learned=True, signal="qci")
    budget = sum(p.band(p.shape(reqs), "qci")) / 2
    before = p.plan(reqs, budget).expected_passes
    for _ in range(6):
        p.observe_verdict("qci", 5, 1, 0.2, False)
    after = p.plan(reqs, budget).expected_passes
    assert after < before and math.isclose(after, 2 / 20, abs_tol=0.03)  # hard's qci pass rate


def test_one_version_of_the_mix_keeps_every_envelope_it_built():
    p = planner(is_mix_learned=True)
    reqs = [PlanRequest(1500, 30, 0, 0.9)]
    budget = sum(p.band(p.shape(reqs), "kv_dev")) / 2
    p.plan(reqs, budget)
    built = dict(p.tables.mixed)
    # hint-free: the search allocated with the mix's envelopes
    assert len(built) > 1 and all("envelopes" in vars(demand) for demand in built.values())
    p.plan(reqs, budget)  # nothing learned in between: every table is reused, none rebuilt
    assert all(p.tables.mixed[k] is v for k, v in built.items()) and p.tables.mixed.keys() == built.keys()
    p.observe_verdict("qci", 5, 1, 0.2, False)
    p.plan(reqs, budget)  # the weights moved: the tables are the new mix's
    assert p.tables.mix_version == ("ServedMix", p.served_mix.version) and p.served_mix.version > 0
    assert all(p.tables.mixed[k] is not v for k, v in built.items() if k in p.tables.mixed)
