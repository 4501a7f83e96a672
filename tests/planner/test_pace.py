"""The planner's learned pace per kind of batch (signal -> plan family -> batch size class), and
plans priced with it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig, PlanRequest
from cachesmith.planner.pace import MAX_PACE, PaceBook, size_class
from tests.planner.synthetic_profile import demand_curve, make_profile

LARGE, SMALL = 9000, 1500  # prompt tokens of a batch: size classes 4 and 1


def test_size_classes_double_from_1k_tokens():
    assert [size_class(n) for n in (1, 1023, 1024, 2047, 2048, 4095, 4096, 8192, 16384)] == [0, 0, 1, 1, 2, 2, 3, 4, 5]
    assert size_class(None) is None


def test_an_unseen_kind_reads_its_parent_and_a_seen_one_its_own():
    book = PaceBook()
    assert book.pace("qci", 1, LARGE) == 1.0  # nothing learned: the raw cost model
    for _ in range(30):
        book.observe("qci", 1.2, probe=1, num_tokens=SMALL)
    assert book.pace("qci", 1, SMALL) == pytest.approx(1.2, rel=1e-6)
    assert book.pace("qci", 1, LARGE) == pytest.approx(1.2, rel=1e-6)  # no batch that large: the family's
    assert book.pace("qci", 0, SMALL) == pytest.approx(1.2, rel=1e-6)  # no shallow batch: the signal's
    # a signal never run reads the machine's pace over every batch, not the raw model's
    assert book.pace("kv_dev", 1, SMALL) == pytest.approx(1.2, rel=1e-6)
    assert set(book.by_signal()) == {"qci"}


def test_a_signal_seen_once_is_shrunk_toward_the_machines_pace():
    book = PaceBook()
    for _ in range(30):
        book.observe("kv_dev", 1.2, probe=0, num_tokens=SMALL)
    book.observe("qci", 0.8, probe=1, num_tokens=SMALL)
    once = book.pace("qci", 1, SMALL)
    assert 0.8 < once < book.pace("kv_dev", 0, SMALL)  # one batch moves it part of the way
    for _ in range(30):
        book.observe("qci", 0.8, probe=1, num_tokens=SMALL)
    assert book.pace("qci", 1, SMALL) == pytest.approx(0.8, abs=0.05)  # its own evidence wins
    assert book.pace("kv_dev", 0, SMALL) == pytest.approx(1.2, abs=0.05)


def test_one_odd_batch_of_a_rare_size_moves_its_pace_part_of_the_way():
    book = PaceBook()
    for _ in range(30):
        book.observe("kv_dev", 1.0, probe=1, num_tokens=SMALL)
    book.observe("kv_dev", 1.9, probe=1, num_tokens=LARGE)
    once = book.pace("kv_dev", 1, LARGE)
    assert 1.0 < once < 1.9  # shrunk toward the family's pace, not believed outright
    for _ in range(30):
        book.observe("kv_dev", 1.9, probe=1, num_tokens=LARGE)
    assert once < book.pace("kv_dev", 1, LARGE) == pytest.approx(1.9, abs=0.12)  # learned with evidence
    assert book.pace("kv_dev", 1, SMALL) < 1.4  # the small batches' pace stays near theirs


def test_wild_paces_are_clipped_and_nonsense_ignored():
    book = PaceBook()
    book.observe("qci", 50.0, probe=1, num_tokens=SMALL)
    assert book.pace("qci", 1, SMALL) == MAX_PACE
    book.observe("qci", float("nan"), probe=1, num_tokens=SMALL)
    book.observe("qci", -1.0, probe=1, num_tokens=SMALL)
    assert book.pace("qci", 1, SMALL) == MAX_PACE


def test_vectorized_paces_equal_one_at_a_time():
    book = PaceBook()
    for n, pace in ((500, 0.9), (3000, 1.1), (5000, 1.3), (20000, 1.8)):
        for _ in range(3):
            book.observe("kv_dev", pace, probe=1, num_tokens=n)
    sizes = np.array([1, 700, 2048, 3000, 4096, 7000, 9000, 20000, 70000])
    want = [book.pace("kv_dev", 1, int(n)) for n in sizes]
    np.testing.assert_allclose(book.paces("kv_dev", 1, sizes), want, rtol=1e-12)


@pytest.fixture()
def shallow_planner():
    profile = make_profile()
    return Planner(replace(profile, demand=profile.demand + (demand_curve("kv_dev", 1, 0.3),)),
                   PlannerConfig(signal="kv_dev"))


def test_plans_are_priced_at_their_own_familys_pace(shallow_planner):
    """Probe plans on large batches ran 1.9x the model, shallow ones on time: a plan's predicted
    TTFT is its family's pace x the model's, within budget, and a small batch keeps its pace."""
    planner = shallow_planner
    for _ in range(20):
        planner.observe("kv_dev", 1.9, probe=1, num_tokens=LARGE)
        planner.observe("kv_dev", 1.0, probe=0, num_tokens=LARGE)
    reqs = [PlanRequest(2200, 50, 0) for _ in range(4)]
    families = set()
    shape = planner.shape(reqs)
    assert size_class(shape.num_tokens) == size_class(LARGE)
    floor, saturation = planner.band(shape, "kv_dev")
    assert planner.pace("kv_dev", 1, shape.num_tokens) == pytest.approx(1.9, abs=0.05)
    assert planner.pace("kv_dev", 0, shape.num_tokens) == pytest.approx(1.0, abs=0.05)
    for frac in (0.3, 0.6, 0.9):
        budget = 1.9 * (floor + frac * (saturation - floor))
        plan = planner.plan(reqs, budget)
        assert plan.status == "planned" and plan.predicted_ttft_s <= budget + 1e-9
        raw = float(planner.cost.ttft(shape, plan.signal, plan.warmup, plan.probe, np.array(plan.coverages))[0])
        pace = planner.pace(plan.signal, plan.probe, shape.num_tokens)
        assert plan.predicted_ttft_s == pytest.approx(pace * raw, rel=1e-6)
        assert raw * (1.9 if plan.probe else 1.0) <= budget * 1.05  # the plan fits at its family's real pace
        families.add(plan.probe > 0)
    assert False in families  # the cheap family is chosen where the slow one would fit too little


def test_the_spread_is_the_books_own_recent_price_error():
    steady, swinging = PaceBook(), PaceBook()
    steady.observe("kv_dev", 1.4, probe=1, num_tokens=SMALL)
    assert steady.spread() == 0.0  # the first batch was priced by the raw model: learning, not noise
    for _ in range(60):
        steady.observe("kv_dev", 1.4, probe=1, num_tokens=SMALL)
    assert steady.spread() < 1e-9  # every batch ran at the price the book gave it
    rng = np.random.default_rng(0)
    seen = []
    for x in rng.normal(0.0, 0.3, 400):
        swinging.observe("kv_dev", 1.4 * float(np.exp(x)), probe=1, num_tokens=SMALL)
        seen.append(swinging.spread())
    # the book's price follows the pace's recent mean, so its error is about the pace's own std (0.3) or above
    # (each reading covers ~20 batches, so it wanders; their mean does not)
    assert 0.27 < np.mean(seen[200:]) < 0.45 and 0.12 < min(seen[200:])


def test_a_machine_that_steadies_lets_the_spread_fall_again():
    book = PaceBook()
    for i in range(100):
        book.observe("qci", 1.0 if i % 2 else 1.5, probe=1, num_tokens=SMALL)
    noisy = book.spread()
    for _ in range(80):
        book.observe("qci", 1.2, probe=1, num_tokens=SMALL)
    assert noisy > 0.15 and book.spread() < 0.2 * noisy


def test_plans_are_sized_for_a_slower_pace_than_the_mean_on_a_swinging_machine(shallow_planner):
    """The plan's price at the mean pace leaves a margin of the budget that grows with the spread;
    the plan keeps the scheduler's budget (the runtime monitor's target) as its own."""
    calm = shallow_planner
    swinging = Planner(calm.profile, replace(calm.config, pace_margin_z=1.5))
    fixed = Planner(calm.profile, replace(calm.config, pace_margin_z=0.0))
    rng = np.random.default_rng(1)
    for x in rng.normal(0.0, 0.25, 200):
        for planner in (swinging, fixed):
            planner.observe("kv_dev", float(np.exp(x)), probe=1, num_tokens=SMALL)
            planner.observe("kv_dev", float(np.exp(x)), probe=0, num_tokens=SMALL)
    for _ in range(200):
        calm.observe("kv_dev", 1.0, probe=1, num_tokens=SMALL)
        calm.observe("kv_dev", 1.0, probe=0, num_tokens=SMALL)
    assert calm.margin() == pytest.approx(1.0, abs=1e-9) and fixed.margin() == 1.0
    margin = swinging.margin()
    assert 1.2 < margin <= swinging.config.max_pace_margin
    reqs = [PlanRequest(700, 40, 0)]
    floor, saturation = calm.band(calm.shape(reqs), "kv_dev")
    budget = fixed.pace("kv_dev", 1, 740) * (floor + 0.7 * (saturation - floor))
    wide, narrow = fixed.plan(reqs, budget), swinging.plan(reqs, budget)
    assert wide.status == "planned" and wide.predicted_ttft_s <= budget + 1e-9
    assert narrow.budget_s == budget and narrow.predicted_ttft_s <= budget / margin + 1e-9
    assert narrow.coverages[0] < wide.coverages[0]


def test_the_margin_is_capped_and_its_settings_checked(shallow_planner):
    planner = Planner(shallow_planner.profile, replace(shallow_planner.config, pace_margin_z=4.0, max_pace_margin=1.3))
    for i in range(50):
        planner.observe("kv_dev", 0.5 if i % 2 else 2.0, probe=1, num_tokens=SMALL)
    assert planner.margin() == 1.3
    with pytest.raises(ConfigError, match="pace_margin_z"):
        PlannerConfig(pace_margin_z=-1.0)
    with pytest.raises(ConfigError, match="max_pace_margin"):
        PlannerConfig(max_pace_margin=0.9)
