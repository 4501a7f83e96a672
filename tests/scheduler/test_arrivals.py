"""The arrival history's prediction of the next arrival, on hand-built arrival times."""
from __future__ import annotations

import pytest

from cachesmith.errors import ConfigError
from cachesmith.scheduler.arrivals import ArrivalHistory


def history(arrivals, **kwargs) -> ArrivalHistory:
    h = ArrivalHistory(**kwargs)
    for i, a in enumerate(arrivals):
        h.observe(i, a, 2.0 + i % 3, 0.5 + 0.1 * (i % 2))
    return h


def test_regular_arrivals_predict_the_rest_of_the_period():
    h = history([float(i) for i in range(20)])  # one a second, the last at 19
    assert h.next_gap(19.0) == pytest.approx(1.0)
    assert h.next_gap(19.4) == pytest.approx(0.6)


def test_a_burst_predicts_the_next_arrival_at_once_and_a_quiet_spell_predicts_the_long_gap():
    arrivals, t = [], 0.0
    for _ in range(4):  # bursts of 8 arrivals 10 ms apart, 20 s between bursts
        arrivals += [t + 0.01 * k for k in range(8)]
        t += 20.0
    h = history(arrivals)
    last = arrivals[-1]
    assert h.next_gap(last) == pytest.approx(0.01)  # right after an arrival: most gaps are short
    # 5 s into a quiet spell only the long gaps are still running: the next burst is ~15 s away
    assert h.next_gap(last + 5.0) == pytest.approx(20.0 - 0.07 - 5.0, abs=1e-6)


def test_no_prediction_from_too_few_arrivals_or_past_every_measured_gap():
    assert history([0.0, 1.0, 2.0]).next_gap(2.0) == float("inf")
    h = history([float(i) for i in range(10)])
    assert h.next_gap(9.0 + 1.5) == float("inf")  # a quiet spell longer than any gap seen


def test_the_window_forgets_the_oldest_arrivals_and_a_request_counts_once():
    h = history([0.0] + [100.0 + 0.1 * i for i in range(10)], max_requests=10)
    assert len(h) == 10 and 0 not in h
    assert h.next_gap(100.9) == pytest.approx(0.1)  # the 100 s gap left with the oldest arrival
    h.observe(5, 1e6, 1.0, 1.0)  # seen already: ignored
    assert h.next_gap(100.9) == pytest.approx(0.1)


def test_the_typical_request_is_the_median():
    h = history([float(i) for i in range(9)])
    assert h.typical() == (pytest.approx(3.0), pytest.approx(0.5))


@pytest.mark.parametrize("kwargs, match", [({"min_requests": 1}, "min_requests"),
                                           ({"max_requests": 4}, "max_requests"),
                                           ({"quantile": 1.0}, "quantile")])
def test_bad_config_is_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ArrivalHistory(**kwargs)
