"""The planner's learned pace per kind of batch (signal -> plan family -> batch size class), and
plans priced with it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

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
