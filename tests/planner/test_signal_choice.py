"""The planner's signal choice (most expected passes; the entropy rule as an ablation) and the
task hint (a batch naming one profiled task plans with that task's demand)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.profile import ProfileError
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
