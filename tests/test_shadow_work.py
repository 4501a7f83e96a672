"""Shadow calibration: sampling, idle-time units on a fake (replay) clock that never move a request's
first token, and the learned demand the samples teach the planner."""
from __future__ import annotations

import numpy as np
import pytest

from cachesmith.clock import ReplayClock
from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.planner.demand import COVERAGE_GRID, DemandModel
from cachesmith.planner.learned_demand import LearnedDemand, LearnedDemandConfig
from cachesmith.planner.profile import NEVER
from cachesmith.shadow_work import ShadowCalibrator, ShadowConfig
from tests.bench.sim_helpers import table
from tests.bench.test_simulator import sim_engine
from tests.planner.synthetic_profile import demand_curve, make_profile

KEYS = [("kv_dev", 2), ("qci", 6)]
UNIT_S = 0.8  # every fake unit takes this long on the fake clock


class FakeSampler:
    """`sample_rounds` of a request in three units (full prefill and two rounds); records each unit
    with the replay clock's time when it started."""

    def __init__(self, clock=None) -> None:
        self.clock, self.units = clock, []

    def sample_rounds(self, inst, keys):
        for step in range(3):
            self.units.append((inst, step, None if self.clock is None else self.clock.now()))
            if step < 2:
                yield
        return {k: (0.05, NEVER) for k in keys}


def calibrator(sink, fraction=1.0, clock=None, **config) -> ShadowCalibrator:
    return ShadowCalibrator(FakeSampler(clock), KEYS, sink, ShadowConfig(fraction=fraction, **config),
                            timer=lambda unit: (unit(), UNIT_S)[1])


def test_offers_are_sampled_at_the_fraction_and_bounded():
    shadow = calibrator([].append, fraction=0.25, max_pending=1000)
    kept = sum(shadow.offer(i) for i in range(4000))
    assert kept == shadow.stats.num_sampled and 850 < kept < 1150  # 25% of 4000, seeded
    full = calibrator([].append, max_pending=2)
    assert [full.offer(i) for i in range(4)] == [True, True, False, False] and full.stats.num_dropped == 2
    with pytest.raises(ConfigError, match="fraction=1.5"):
        ShadowConfig(fraction=1.5)


def test_units_run_only_where_they_fit_before_the_next_arrival():
    samples = []
    clock = ReplayClock()
    shadow = calibrator(samples.append, clock=clock, initial_unit_s=UNIT_S)
    shadow.offer("a")
    assert shadow.run_idle(clock, until_s=0.5) == 0 and clock.now() == 0.0  # a unit does not fit
    assert shadow.run_idle(clock, until_s=2.0) == 2 and clock.now() == pytest.approx(1.6)  # two fit, not three
    assert samples == [] and shadow.has_work
    assert shadow.run_idle(clock, until_s=10.0) == 1 and samples == [{k: (0.05, NEVER) for k in KEYS}]
    assert not shadow.has_work and shadow.stats.num_samples == 1 and shadow.stats.max_unit_s == UNIT_S
    shadow.offer("b")
    assert shadow.run_idle(clock) == 1  # live: one unit, then the loop looks again


def test_shadow_work_never_moves_a_requests_first_token_on_the_replay_clock():
    profile, t = make_profile(), table()
    # pairs and singles: idle gaps of several units, and arrivals during busy time
    arrivals = [0.0, 0.05, 6.0, 6.05, 12.0, 18.0, 18.05, 25.0, 31.0, 31.5]
    plain_engine = sim_engine("cachesmith", profile, t, decision_s=0.0)
    plain = plain_engine.run([plain_engine.executor.request(i, o, 4.0, a)
                              for i, (o, a) in enumerate(zip(t.outcomes, arrivals))])
    engine = sim_engine("cachesmith", profile, t, decision_s=0.0)
    reqs = [engine.executor.request(i, o, 4.0, a) for i, (o, a) in enumerate(zip(t.outcomes, arrivals))]
    samples = []
    engine.shadow = calibrator(samples.append, clock=engine.clock, initial_unit_s=UNIT_S)
    shadowed = engine.run(reqs)
    assert [r.first_token_s for r in shadowed] == [r.first_token_s for r in plain]
    assert [r.plan for r in shadowed] == [r.plan for r in plain]
    units = engine.shadow.profiler.units
    assert engine.shadow.stats.num_units == len(units) > 0 and samples  # idle time was used
    prefills = [(r.first_token_s - r.batch_s, r.first_token_s) for r in shadowed]
    for _, _, start in units:  # no unit overlaps a batch, nor runs past an arrival
        end = start + UNIT_S
        assert all(end <= a + 1e-9 or start >= a - 1e-9 for a in arrivals)
        assert all(end <= s + 1e-9 or start >= e - 1e-9 for s, e in prefills)


def two_signal_prior():
    curves = tuple(demand_curve(s, d, m, num=100) for s, m in (("kv_dev", 0.15), ("qci", 0.5)) for d in (2, 6, 15))
    return DemandModel(curves)


def test_samples_pool_with_the_prior_and_verdicts_count_where_they_speak():
    prior = two_signal_prior()
    learned = LearnedDemand(prior, LearnedDemandConfig(prior_weight=10))
    assert not learned.is_active and learned.shift() == pytest.approx(0.0, abs=1e-12)
    for _ in range(30):  # this workload: qci passes from 5% at every depth
        learned.observe_sample({("qci", d): (0.05, NEVER) for d in (2, 6, 15)})
    want = (10 * prior.cdf("qci", 6) + 30 * (COVERAGE_GRID >= 0.05 - 1e-9)) / 40
    assert learned.is_active and np.allclose(learned.cdf("qci", 6), want)
    assert np.allclose(learned.cdf("kv_dev", 6), prior.cdf("kv_dev", 6))  # nothing said about kv_dev
    assert learned.shift() >= np.abs(want - prior.cdf("qci", 6)).max() > 0.5
    before = learned.anchor_cdf("kv_dev", 2)
    learned.observe_verdict("kv_dev", 3, 0.2, passed=False)  # depth 3 counts for anchor 2
    after = learned.anchor_cdf("kv_dev", 2)
    low = COVERAGE_GRID <= 0.2 + 1e-9
    assert np.all(after[low] < before[low] + 1e-12) and np.allclose(after[~low], before[~low])  # only <= 20% moved


def test_a_learning_planner_takes_the_signal_its_samples_favour():
    profile = make_profile()  # its demand favours qci clearly (200 requests a curve)
    planner = Planner(profile, PlannerConfig(is_mix_learned=True))
    reqs = [PlanRequest(1500, 30, 0, 0.5) for _ in range(2)]
    budget = sum(planner.band(planner.shape(reqs), "kv_dev")) / 2
    assert planner.plan(reqs, budget).signal == "qci"
    for _ in range(40):  # the served workload: query-context ranking never restores it, KV deviation from 5%
        planner.observe_sample({**{("qci", d): (NEVER, NEVER) for d in (2, 6, 15)},
                                **{("kv_dev", d): (0.05, NEVER) for d in (2, 6, 15)}})
    assert planner.learned.is_active and planner.plan(reqs, budget).signal == "kv_dev"
    assert Planner(profile).plan(reqs, budget).signal == "qci"  # a planner that does not learn stays


def test_the_window_forgets_its_oldest_samples():
    prior = two_signal_prior()
    learned = LearnedDemand(prior, LearnedDemandConfig(prior_weight=10, max_samples=5))
    for _ in range(5):
        learned.observe_sample({("qci", 6): (NEVER, NEVER)})  # an old workload: qci never passes
    for _ in range(5):
        learned.observe_sample({("qci", 6): (0.05, NEVER)})  # the current one: from 5%
    want = (10 * prior.cdf("qci", 6) + 5 * (COVERAGE_GRID >= 0.05 - 1e-9)) / 15
    assert np.allclose(learned.anchor_cdf("qci", 6), want)  # only the latest five count
