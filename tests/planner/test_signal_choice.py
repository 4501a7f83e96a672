"""The planner's signal choice (KV deviation unless another signal is better under every known
demand by its sampling error; the most expected passes and the entropy rule as ablations) and the
task hint (a batch naming one profiled task plans with that task's demand)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.profile import NEVER, DemandCurve, ProfileError
from cachesmith.planner.signal_choice import Evidence, beats, margin
from tests.planner.synthetic_profile import demand_curve, make_profile

DEPTHS = (2, 6, 15)


def curves(kv_median: float, qci_median: float, task: str | None = None):
    out = []
    for signal, median in (("kv_dev", kv_median), ("qci", qci_median)):
        for i, depth in enumerate(DEPTHS):
            c = demand_curve(signal, depth, median * (1 - 0.2 * i), never=0.05)
            out.append(replace(c, task=task))
    return tuple(out)


def planner_with(demand, **config) -> Planner:
    return Planner(replace(make_profile(), demand=demand), PlannerConfig(**config))


def requests(entropy: float, task: str | None = None, num: int = 2):
    return [PlanRequest(1500, 30, 0, entropy, task) for _ in range(num)]


def mid_budget(planner: Planner, reqs) -> float:
    floor, saturation = planner.band(planner.shape(reqs), "kv_dev")
    return floor + 0.4 * (saturation - floor)


@pytest.mark.parametrize("kv, qci, want", [(0.1, 0.6, "kv_dev"), (0.6, 0.1, "qci")])
def test_the_signal_with_more_expected_passes_wins_whatever_the_entropy(kv, qci, want):
    p = planner_with(curves(kv, qci))
    for entropy in (0.05, 0.95):  # the entropy rule would pick qci, then kv_dev
        reqs = requests(entropy)
        plan = p.plan(reqs, mid_budget(p, reqs))
        assert plan.signal == want
        other = planner_with(curves(kv, qci), signal="qci" if want == "kv_dev" else "kv_dev")
        assert plan.expected_passes > other.plan(reqs, mid_budget(p, reqs)).expected_passes


def test_the_entropy_rule_is_kept_as_an_ablation():
    p = planner_with(curves(0.1, 0.6), signal_rule="entropy")
    assert p.plan(requests(0.05), 1.0).signal == "qci"  # below theta: qci, though it expects fewer passes
    assert p.plan(requests(0.95), 1.0).signal == "kv_dev"
    with pytest.raises(ConfigError, match="signal_rule='coin'"):
        PlannerConfig(signal_rule="coin")


def test_a_batch_naming_one_profiled_task_plans_with_its_demand():
    demand = curves(0.1, 0.6) + curves(0.7, 0.05, task="vt")  # the mix favours kv_dev, vt favours qci
    hinted = planner_with(demand, use_task_hint=True)
    reqs = requests(0.5, "vt")
    budget = mid_budget(hinted, reqs)
    plan = hinted.plan(reqs, budget)
    assert (plan.signal, plan.task) == ("qci", "vt")
    assert planner_with(demand, use_task_hint=False).plan(reqs, budget).signal == "kv_dev"  # hint-free
    mixed = requests(0.5, "vt", 1) + requests(0.5, "pr", 1)  # two tasks: the served mix prices it
    assert (hinted.plan(mixed, budget).signal, hinted.plan(mixed, budget).task) == ("kv_dev", None)
    unknown = hinted.plan(requests(0.5, "custom"), budget)  # no curves of its own: the mix
    assert (unknown.signal, unknown.task) == ("kv_dev", None)


def test_task_demand_falls_back_to_the_mix_and_needs_a_mix():
    model = DemandModel(curves(0.2, 0.4) + curves(0.6, 0.6, task="msq"))
    assert model.tasks == ["msq"] and model.signals == ["kv_dev", "qci"]
    assert (model.cdf("kv_dev", 6, "msq") <= model.cdf("kv_dev", 6) + 1e-12).all()  # msq needs more
    assert (model.cdf("kv_dev", 6, "pr") == model.cdf("kv_dev", 6)).all()
    with pytest.raises(ProfileError, match="all per task"):
        DemandModel(curves(0.2, 0.4, task="msq"))


def test_per_task_curves_survive_the_profile_file(tmp_path):
    profile = replace(make_profile(), demand=curves(0.2, 0.4) + curves(0.6, 0.3, task="vt"))
    profile.save(tmp_path / "p.json")
    again = type(profile).load(tmp_path / "p.json")
    assert again == profile and {c.task for c in again.demand} == {None, "vt"}


def test_cacheblends_family_is_a_candidate_where_its_demand_was_measured():
    shallow = replace(demand_curve("kv_dev", 1, 0.05, never=0.05), rank_depth=1)  # (kv_dev, 1, 0) needs little
    with_shallow = planner_with(curves(0.4, 0.6) + (shallow,))
    reqs = requests(0.5)
    budget = mid_budget(with_shallow, reqs)
    plan = with_shallow.plan(reqs, budget)
    assert (plan.signal, plan.warmup, plan.probe) == ("kv_dev", 1, 0) and plan.predicted_ttft_s <= budget
    assert with_shallow.signal_depths("kv_dev")[0] == 1 and 1 not in with_shallow.signal_depths("qci")
    without = planner_with(curves(0.4, 0.6)).plan(reqs, budget)  # never measured: never planned
    assert without.probe >= 1 and without.expected_passes < plan.expected_passes


def test_a_challenger_must_clear_the_sampling_error_of_the_demand():
    default, challenger = object(), object()
    probs = {id(default): np.full(4, 0.40), id(challenger): np.full(4, 0.50)}  # +0.4 expected passes

    def ev(n):
        return Evidence(None, n, lambda plan: probs[id(plan)])
    assert margin(probs[id(default)], probs[id(challenger)], 400) == pytest.approx(4 * np.sqrt(0.49 / 400))
    assert beats(challenger, default, [ev(400)], z=1.0)  # margin 0.14: cleared
    assert not beats(challenger, default, [ev(20)], z=1.0)  # margin 0.63: within the noise
    assert beats(challenger, default, [ev(20)], z=0.0)  # without the margin, the passes rule's answer
    assert not beats(default, challenger, [ev(400)], z=0.0)


def test_kv_deviation_holds_unless_every_known_task_prefers_the_challenger():
    mix_favours_qci = curves(0.6, 0.1)
    split = mix_favours_qci + curves(0.6, 0.1, task="pr") + curves(0.1, 0.6, task="vt")  # vt disagrees
    robust, passes = planner_with(split), planner_with(split, signal_rule="passes")
    reqs = requests(0.5)
    budget = mid_budget(robust, reqs)
    assert passes.plan(reqs, budget).signal == "qci"  # the mix alone says qci
    assert robust.plan(reqs, budget).signal == "kv_dev"  # vt's curves say the mix may be wrong
    agree = planner_with(mix_favours_qci + curves(0.6, 0.1, task="pr") + curves(0.5, 0.1, task="vt"))
    assert agree.plan(reqs, budget).signal == "qci"  # every demand it knows says qci, by far
    hinted = planner_with(split, use_task_hint=True).plan(requests(0.5, "pr"), budget)
    assert (hinted.signal, hinted.task) == ("qci", "pr")  # a hinted batch answers to its task only


def test_a_small_profile_keeps_kv_deviation_on_a_small_gain():
    def flat(signal: str, share: float, num: int):  # `share` of the requests pass from 5% on
        passing = round(share * num)
        return tuple(DemandCurve(signal, d, (0.05,) * passing + (NEVER,) * (num - passing)) for d in DEPTHS)
    reqs = requests(0.5)
    for num, want in ((8, "kv_dev"), (400, "qci")):  # margin 2 sqrt(0.49 / n): 0.49 at 8, 0.07 at 400
        demand = flat("kv_dev", 0.40, num) + flat("qci", 0.50, num)  # qci: +0.2 expected passes
        robust, passes = planner_with(demand), planner_with(demand, signal_rule="passes")
        budget = mid_budget(robust, reqs)
        assert passes.plan(reqs, budget).signal == "qci"
        assert robust.plan(reqs, budget).signal == want, num
