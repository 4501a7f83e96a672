"""The demand profiler's passing interval per request, against known verdict curves (no model)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cachesmith.errors import InputError
from cachesmith.gates import make_gate
from cachesmith.planner.profile import NEVER
from cachesmith.calibration.demand import GRID_STEPS, DemandProfiler, plan_at, task_curves
from cachesmith.calibration.subjects import Subject
from cachesmith.model.tokenizer import PromptParts
from cachesmith.recompute import RecomputeConfig
from cachesmith.scoring import Expected


class FakeProfiler(DemandProfiler):
    """Verdicts from `curve(coverage, tag)`; full prefill's is `curve(1.0, "full_prefill")`.
    Records each measuring call's trials (one call = one round measured together)."""

    def __init__(self, curve, gate: str = "task") -> None:
        self.pipe = SimpleNamespace(model=SimpleNamespace(num_layers=30))
        self.gate, self._gate = gate, make_gate(gate)
        self.curve, self.calls, self.rounds = curve, [], []

    def measure_many(self, batch) -> list[list[dict]]:
        self.rounds.append([tag for _, trials in batch for _, tag in trials])
        self.calls += [plan.coverage for _, trials in batch for plan, _ in trials]
        return [self._records(inst, trials) for inst, trials in batch]

    def _records(self, inst, trials: list[tuple[RecomputeConfig, str]]) -> list[dict]:
        curve = self.curve if inst is None or not isinstance(inst, int) else (lambda r, tag: self.curve(r, tag, inst))
        if self.gate == "task":
            return [{"passed": curve(plan.coverage, tag)} for plan, tag in trials]
        # fidelity: the curve gives the answer text; the task verdict says nothing (no gold)
        return [{"passed": False, "text": curve(plan.coverage, tag)} for plan, tag in trials]


@pytest.mark.parametrize("curve, interval", [
    (lambda r, _: r >= 0.35 - 1e-9, (0.35, NEVER)),  # the usual flip: from its demand on
    (lambda r, _: True, (0.0, NEVER)),  # full reuse passes already
    (lambda r, _: False, (NEVER, NEVER)),  # nothing passes
    (lambda r, _: r < 0.4 - 1e-9, (0.0, 0.4)),  # full prefill fails it; below 40% it passes
])
def test_pass_interval_finds_where_the_verdict_flips_either_way(curve, interval):
    profiler = FakeProfiler(curve)
    assert profiler.pass_intervals(None, [("qci", 6)])[("qci", 6)] == pytest.approx(interval)
    assert len(profiler.calls) <= 2 + GRID_STEPS.bit_length()  # binary search, not a sweep


@pytest.mark.parametrize("threshold", [0.05, 0.35, 0.6, 1.0])
def test_flip_search_finds_the_first_grid_step_with_the_full_prefill_verdict(threshold):
    m = FakeProfiler(lambda r, _: r >= threshold - 1e-9)
    assert m.flips(None, [("kv_dev", 6)], high=True) == {("kv_dev", 6): (False, threshold)}
    assert len(m.calls) <= 1 + GRID_STEPS.bit_length()
    m = FakeProfiler(lambda r, _: r < threshold - 1e-9)  # passes at reuse, fails as full prefill does
    assert m.flips(None, [("qci", 2)], high=False) == {("qci", 2): (True, threshold)}
    m = FakeProfiler(lambda r, _: True)
    assert m.flips(None, [("qci", 2)], high=True) == {("qci", 2): (True, 1.0)} and m.calls == [0.0]


def test_searches_run_in_lockstep_one_round_per_step():
    # four searches with different flips: every round measures one step of each unfinished search
    thresholds = {("kv_dev", 1): 0.05, ("kv_dev", 6): 0.35, ("qci", 2): 0.8, ("qci", 15): 0.0}
    m = FakeProfiler(lambda r, tag: r >= thresholds[(tag.split("/")[0], int(tag.split("/")[1]))] - 1e-9)
    found = m.flips(None, list(thresholds), high=True)
    assert found == {k: (t == 0.0, 1.0 if t == 0.0 else t) for k, t in thresholds.items()}
    assert m.rounds[0] == ["kv_dev/1/0", "kv_dev/6/0", "qci/2/0", "qci/15/0"]  # step 0 of all four at once
    assert len(m.rounds) <= 1 + GRID_STEPS.bit_length()  # rounds, not searches x steps
    assert all(len(r) == len({t.rsplit("/", 1)[0] for t in r}) for r in m.rounds)  # one step per search a round
    assert [t for r in m.rounds for t in r if t.startswith("qci/15/")] == ["qci/15/0"]  # passed at 0%: done
    assert plan_at("kv_dev", 1, 3) == RecomputeConfig("kv_dev", 1, 0, 0.15)  # depth 1: CacheBlend's (1, 0)
    assert plan_at("qci", 6, 4) == RecomputeConfig("qci", 5, 1, 0.2)
    assert plan_at("qci_last", 30, 4) == RecomputeConfig("qci_last", 1, 29, 0.2)  # the last-layer family
    assert plan_at("fused", 30, 4) == RecomputeConfig("fused", 1, 29, 0.2)  # the fused family


def test_task_curves_keep_until_only_where_a_request_fails_again():
    demands = {("kv_dev", 2): [0.1, 0.0, None, 0.2]}
    curves = task_curves(demands, ["pr", "vt", "pr", "vt"], {("kv_dev", 2): [NEVER, 0.3, None, NEVER]})
    by = {c.task: c for c in curves}
    assert by[None].demands == (0.1, 0.0, 0.2) and by[None].until == (NEVER, 0.3, NEVER)
    assert by["pr"].demands == (0.1,) and by["pr"].until is None  # none of its requests fails again
    assert by["vt"].until == (0.3, NEVER)
    assert task_curves(demands, ["pr"] * 4)[0].until is None  # no `until` given: none fails again


def test_the_fidelity_gate_profiles_requests_without_gold():
    """An answer passes when its canonical form equals full prefill's; the gold is never read."""
    inst = Subject("d0", Expected("custom"), 8, PromptParts([], [[1, 2]], [3]))  # no gold

    def answer(r, tag):  # below 45% the model names another town; from there on, full prefill's
        return "Port Lantern, a town." if tag == "full_prefill" or r >= 0.45 - 1e-9 else "Oakridge."

    profiler = FakeProfiler(answer, gate="fidelity")
    assert profiler.pass_intervals(inst, [("kv_dev", 6)])[("kv_dev", 6)] == pytest.approx((0.45, NEVER))
    same = FakeProfiler(lambda r, tag: "port lantern" if r < 1 else "Port Lantern.", gate="fidelity")
    assert same.pass_intervals(inst, [("qci", 2)])[("qci", 2)] == pytest.approx((0.0, NEVER))  # same canonical form
    with pytest.raises(InputError, match="gate='exact'"):
        DemandProfiler(None, Path("unused.jsonl"), gate="exact")


@pytest.mark.parametrize("threshold, want, num_calls", [
    (0.35, 0.35, None),  # below the cap: found as before
    (0.5, 0.5, None),
    (0.55, 1.0, 2),  # above it: recorded at full prefill's after two trials (0% and the cap)
    (0.9, 1.0, 2),
])
def test_a_capped_search_records_flips_above_the_cap_at_full_prefill(threshold, want, num_calls):
    m = FakeProfiler(lambda r, _: r >= threshold - 1e-9)
    m.max_coverage = 0.5
    assert m.flips(None, [("kv_dev", 6)], high=True) == {("kv_dev", 6): (False, want)}
    assert max(m.calls) <= 0.5 + 1e-9  # nothing above the cap is ever measured
    if num_calls is not None:
        assert len(m.calls) == num_calls
    uncapped = FakeProfiler(lambda r, _: r >= threshold - 1e-9)
    assert uncapped.flips(None, [("kv_dev", 6)], high=True)[("kv_dev", 6)] == (False, threshold)
    with pytest.raises(InputError, match="max_coverage=0.33"):
        DemandProfiler(None, Path("unused.jsonl"), max_coverage=0.33)


def test_several_requests_run_in_lockstep_and_keep_their_own_answers():
    thresholds = {0: 0.1, 1: 0.45, 2: 0.8}  # request index -> its flip
    m = FakeProfiler(lambda r, _, inst: r >= thresholds[inst] - 1e-9)
    found = m.flips_many([0, 1, 2], [("qci", 6)], [True, True, True])
    assert [f[("qci", 6)] for f in found] == [(False, 0.1), (False, 0.45), (False, 0.8)]
    assert m.rounds[0] == ["qci/6/0"] * 3  # one round holds every request's step
    alone = []
    for t in thresholds.values():
        single = FakeProfiler(lambda r, _: r >= t - 1e-9)
        single.flips(None, [("qci", 6)], high=True)
        alone.append(len(single.rounds))
    assert len(m.rounds) == max(alone) and sum(map(len, m.rounds)) == sum(alone)  # the longest search's rounds
