"""`benchmarks/overload.py`'s statistics: paired differences per level, with a bootstrap interval
over the traces, and the arrival patterns (Poisson, Gamma with a CV)."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import overload


def _row(load, pattern, repeat, shedding, on_time, qsa, refused=0):
    return {"load": load, "pattern": pattern, "repeat": repeat, "shedding": shedding, "on_time": on_time,
            "qsa": qsa, "sent": 10, "refused_arrival": refused, "pair_position": 1}


def test_paired_differences_are_within_each_trace_and_their_interval_holds_the_mean():
    rows = []
    for repeat, (on, off) in enumerate([(9, 7), (8, 8), (10, 7), (6, 7), (9, 6), (8, 7)], 1):
        rows += [_row(2.0, "poisson", repeat, "1.5x", on, on / 10, refused=1), _row(2.0, "poisson", repeat, "off", off, off / 10)]
    rows += [_row(2.0, "gamma cv4", 1, "1.5x", 5, 0.5), _row(2.0, "gamma cv4", 1, "off", 6, 0.6)]
    out = overload.paired(rows)
    assert [r["level"] for r in out] == ["2x poisson", "2x gamma cv4"]  # Poisson first
    poisson = out[0]
    assert poisson["repeats"] == 6 and poisson["on_time_diff"] == pytest.approx(8 / 6)
    assert poisson["on_time_diff_lo"] < poisson["on_time_diff"] < poisson["on_time_diff_hi"]
    assert poisson["qsa_diff"] == pytest.approx(8 / 60) and poisson["refused_arrival_on"] == 6
    assert out[1]["on_time_diff"] == -1 and out[1]["on_time_diff_lo"] == out[1]["on_time_diff_hi"] == -1


def test_the_bootstrap_interval_narrows_with_more_traces_and_is_seeded():
    rng = np.random.default_rng(3)
    few, many = rng.normal(1.0, 2.0, 6).tolist(), rng.normal(1.0, 2.0, 60).tolist()
    lo_few, hi_few = overload.bootstrap_interval(few)
    lo_many, hi_many = overload.bootstrap_interval(many)
    assert hi_many - lo_many < hi_few - lo_few
    assert overload.bootstrap_interval(few) == (lo_few, hi_few)


def test_gamma_arrivals_are_burstier_than_poisson_at_one_rate():
    poisson = np.diff(overload.arrivals("poisson", 4000, 2.0, seed=1))
    gamma = np.diff(overload.arrivals("gamma", 4000, 2.0, seed=1, cv=4.0))
    assert poisson.mean() == pytest.approx(0.5, rel=0.1) and gamma.mean() == pytest.approx(0.5, rel=0.25)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    assert gamma.std() / gamma.mean() > 3.0
