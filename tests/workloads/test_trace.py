"""Arrival traces: rate and CV statistics over 10k samples, determinism, JSONL round trip, errors."""
from __future__ import annotations

import numpy as np
import pytest

from cachesmith.errors import ConfigError, InputError
from cachesmith.workloads.trace import Trace, TraceConfig, make_trace, rate_for_utilization


@pytest.mark.parametrize("pattern, cv", [("poisson", 1.0), ("gamma", 2.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_rate_and_cv_over_10k_samples(pattern, cv):
    trace = make_trace(TraceConfig(pattern=pattern, rate_rps=4.0, cv=cv, num_requests=10_000, seed=3))
    assert trace.mean_rate_rps() == pytest.approx(4.0, rel=0.1 if cv > 2 else 0.05)
    assert trace.interarrival_cv() == pytest.approx(cv, rel=0.1)


def test_deterministic_and_seed_sensitive():
    config = TraceConfig(pattern="gamma", cv=2.0, num_requests=50, seed=1)
    assert make_trace(config) == make_trace(config)
    assert make_trace(TraceConfig(pattern="gamma", cv=2.0, num_requests=50, seed=2)) != make_trace(config)


def test_slo_is_base_times_scale():
    fixed = make_trace(TraceConfig(base_slo_s=1.5, slo_scale=3.0, num_requests=20))
    assert {r.slo_s for r in fixed.requests} == {4.5}
    drawn = make_trace(TraceConfig(base_slo_s=2.0, slo_scale=1.0, slo_scale_max=4.0, num_requests=500))
    slos = np.array([r.slo_s for r in drawn.requests])
    assert slos.min() >= 2.0 and slos.max() <= 8.0 and slos.std() > 1.0


def test_jsonl_round_trip(tmp_path):
    trace = make_trace(TraceConfig(pattern="gamma", cv=3.0, num_requests=30, task="pr", seed=5))
    trace.save(tmp_path / "t.jsonl")
    assert Trace.load(tmp_path / "t.jsonl") == trace


def test_bad_trace_files_name_the_file(tmp_path):
    with pytest.raises(InputError, match="missing.jsonl"):
        Trace.load(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"config": {"pattern": "poisson"}}\n{"request_id": 0}\n')
    with pytest.raises(InputError, match="bad.jsonl.*malformed"):
        Trace.load(bad)


@pytest.mark.parametrize("kwargs, field", [
    ({"pattern": "uniform"}, "pattern"), ({"rate_rps": 0}, "rate_rps"), ({"cv": -1, "pattern": "gamma"}, "cv"),
    ({"cv": 2.0}, "cv"), ({"num_requests": 0}, "num_requests"), ({"base_slo_s": -1}, "base_slo_s"),
    ({"slo_scale": 2, "slo_scale_max": 1}, "slo_scale_max"),
])
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TraceConfig(**kwargs)


def test_rate_for_utilization():
    assert rate_for_utilization(0.8, 2.0) == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="utilization"):
        rate_for_utilization(0, 2.0)
