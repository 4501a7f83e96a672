"""Outcome tables: verdict lookups, the flip search, persistence."""
from __future__ import annotations

import json

import pytest

from cachesmith.errors import InputError
from cachesmith.recompute import preset
from cachesmith.bench.outcomes import Flip, OutcomeTable
from tests.bench.sim_helpers import NUM_LAYERS, outcome, table


def test_flip_gives_the_low_verdict_below_and_the_full_prefill_one_from_it():
    f = Flip(low=False, high=True, at=0.35)
    assert not f.passes(0.3) and f.passes(0.35) and f.passes(0.9)
    assert Flip(True, False, 0.2).passes(0.1) and not Flip(True, False, 0.2).passes(0.25)


def test_lookup_uses_measured_plans_flips_by_depth_and_the_closest_static_below():
    t = table()
    o = outcome(1, full=True, reuse=False, at=0.3)
    o.plans[preset("epic", 0.15, NUM_LAYERS).label()] = True  # before the first lookup parses the plans
    assert t.passes(o, "position", NUM_LAYERS, 0, 1.0) is True  # full prefill
    assert t.passes(o, "kv_dev", 1, 0, 0.3) is True  # a measured preset, exactly
    assert t.passes(o, "kv_dev", 1, 0, 0.15) is False
    assert t.passes(o, "kv_dev", 1, 1, 0.25) is False and t.passes(o, "kv_dev", 1, 1, 0.3) is True  # depth 2
    assert t.passes(o, "qci", 5, 1, 0.2) is True  # depth 6 needs 0.2
    assert t.passes(o, "qci", 3, 1, 0.2) is False  # depth 4: anchors 2 and 6 disagree, a tie goes low
    assert t.passes(o, "qci", 4, 1, 0.2) is True  # depth 5: nearer to 6
    assert t.passes(o, "qci", 20, 5, 0.1) is True  # beyond the deepest anchor: the deepest
    # EPIC at a coverage between the measured ones: the closest measured at or below
    assert t.passes(o, "position", 0, 0, 0.2) is True and t.passes(o, "position", 0, 0, 0.1) is False


def test_tables_round_trip_and_select_tasks(tmp_path):
    t = table()
    t.save(tmp_path / "t.json")
    back = OutcomeTable.load(tmp_path / "t.json")
    assert back == t
    assert {o.task for o in back.by_task("pr+vt")} == {"pr", "vt"} and len(back.by_task("mix")) == 24
    with pytest.raises(InputError, match="no instance of task 'hotpot'"):
        back.by_task("hotpot")
    (tmp_path / "bad.json").write_text(json.dumps({"model": "x"}))
    with pytest.raises(InputError, match="cannot be read"):
        OutcomeTable.load(tmp_path / "bad.json")


def test_demand_curves_from_outcomes_count_never_zero_and_flip_points_per_task():
    from cachesmith.bench.outcomes import demand_curves
    from cachesmith.planner.profile import NEVER

    outs = [outcome(0, "pr", full=True, reuse=False, at=0.3, entropy=0.9),  # needs 30% at depth 2
            outcome(1, "pr", full=True, reuse=True, entropy=0.9),  # passes at 0%
            outcome(2, "vt", full=False, reuse=False, entropy=0.2),  # full prefill fails: never
            outcome(3, "vt", full=False, reuse=True, at=0.2, entropy=0.2)]  # passes below 20% only
    curves, theta = demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, outs))
    by = {(c.task, c.signal, c.rank_depth): c.demands for c in curves}
    until = {(c.task, c.signal, c.rank_depth): c.until for c in curves}
    assert by[(None, "kv_dev", 2)] == (0.3, 0.0, NEVER, 0.0)
    assert until[(None, "kv_dev", 2)] == (NEVER, NEVER, NEVER, 0.2)  # fails again from its flip
    assert by[(None, "qci", 6)] == pytest.approx((0.2, 0.0, NEVER, 0.0))  # deeper anchors need 0.1 less
    assert until[(None, "qci", 6)] == pytest.approx((NEVER, NEVER, NEVER, 0.1))
    assert by[("pr", "kv_dev", 15)] == pytest.approx((0.1, 0.0)) and until[("pr", "kv_dev", 15)] is None
    assert by[("vt", "qci", 2)] == (NEVER, 0.0) and until[("vt", "qci", 2)] == (NEVER, 0.2)
    # CacheBlend's (1, 0): passes from its 30% preset; the last passes at 5-15% and fails from 30%
    assert by[(None, "kv_dev", 1)] == (0.3, 0.0, NEVER, 0.0) and until[(None, "kv_dev", 1)][3] == 0.3
    curve = next(c for c in curves if (c.task, c.signal, c.rank_depth) == (None, "kv_dev", 2))
    # at 10% two pass (one from 0%, one below its 20% flip); at 25% one; at 30% two again
    assert curve.pass_rate([0.1, 0.25, 0.3, 1.0]).tolist() == [0.5, 0.25, 0.5, 0.5]
    assert {t for t, _, _ in by} == {None, "pr", "vt"} and len(curves) == 3 * 9  # + the fixed-split families
    assert 0.0 <= theta <= 1.0
    flips_only = outcome(4, "pr", full=True, reuse=False, at=0.1)
    flips_only.plans = {k: v for k, v in flips_only.plans.items() if not k.startswith("(kv_dev,1,0,")}
    with_it = {(c.task, c.signal, c.rank_depth): c.demands
               for c in demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, outs + [flips_only]))[0]}
    assert with_it[(None, "kv_dev", 1)] == by[(None, "kv_dev", 1)]  # no CacheBlend presets: left out there
    assert with_it[(None, "kv_dev", 2)][-1] == 0.1 and len(with_it[(None, "kv_dev", 2)]) == 5  # counted here
    single = demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, outs[:2]))[0]
    assert {c.task for c in single} == {None}  # one task: its curves are the mix's
    with pytest.raises(InputError, match="no instance"):
        demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, []))


@pytest.mark.parametrize("signal", ["qci_last", "fused"])
def test_each_fixed_family_is_measured_judged_and_given_demand_where_measured(signal):
    """(qci_last, 1, L - 1) and (fused, 1, L - 1): among every table's fixed plans and a flips-only
    instance's, judged at the closest measured coverage at or below, and a demand curve at rank
    depth L from the instances that have it (left out elsewhere)."""
    from cachesmith.bench.outcomes import LAST_COVERAGES, demand_curves, fixed_families, fixed_plans
    from cachesmith.planner.profile import NEVER

    family = next(f for f in fixed_families(NUM_LAYERS) if f[0] == signal)
    assert family == (signal, 1, NUM_LAYERS - 1)
    label = f"({signal},1,{NUM_LAYERS - 1},{{}}%)"
    labels = [p.label() for p in fixed_plans(NUM_LAYERS)]
    assert all(label.format(round(100 * c)) in labels for c in LAST_COVERAGES)
    t = table()
    o = outcome(5, "msq", full=True, reuse=False, at=0.3)
    o.plans.update({label.format(round(100 * c)): c >= 0.10 for c in LAST_COVERAGES})
    assert t.passes(o, *family, 0.05) is False and t.passes(o, *family, 0.12) is True
    assert t.passes(o, *family, 1.0) is True  # full prefill's verdict at 100%
    never = outcome(6, "msq", full=False, reuse=False)
    never.plans.update({label.format(round(100 * c)): False for c in LAST_COVERAGES})
    unmeasured = outcome(7, "msq", full=True, reuse=False, at=0.2)
    unmeasured.plans = {k: v for k, v in unmeasured.plans.items() if not k.startswith(f"({signal},1,")}
    curves, _ = demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, [o, never, unmeasured]))
    curve = next(c for c in curves if c.task is None and c.signal == signal)
    assert curve.rank_depth == NUM_LAYERS and curve.demands == (0.10, NEVER)  # the unmeasured one left out
    without = demand_curves(OutcomeTable("synthetic", NUM_LAYERS, 8192, [unmeasured]))[0]
    assert not any(c.signal == signal for c in without)  # no table measured it: no curve at all
