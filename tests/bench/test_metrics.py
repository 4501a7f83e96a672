"""Summary metrics and BestStatic on hand-built records (no model)."""
from __future__ import annotations

import pytest

from cachesmith.bench.metrics import KEYS, best_static, summarize
from cachesmith.engine import EngineStats


def record(rid, arrival, first, slo, passed, error=None):
    ttft = None if first is None else first - arrival
    on_time = ttft is not None and ttft <= slo
    return {"request_id": rid, "arrival_s": arrival, "first_token_s": first, "ttft_s": ttft, "slo_s": slo,
            "error": error, "is_passed": passed, "is_on_time": on_time, "is_qsa": on_time and passed,
            "num_recomputed": 10, "num_context_tokens": 100}


def test_summary_counts_qsa_only_when_on_time_and_passed():
    recs = [record(0, 0.0, 1.0, 2.0, True), record(1, 0.0, 3.0, 2.0, True),  # late
            record(2, 1.0, 2.0, 2.0, False),  # wrong
            record(3, 1.0, None, 2.0, False, error="slo_s=0 must be positive")]
    stats = EngineStats(num_batches=2, busy_s=3.0, stall_s=0.3, decision_ms=[1.0, 3.0])
    row = summarize("m", 2.0, recs, stats)
    assert set(KEYS) <= set(row)
    assert row["qsa"] == 0.25 and row["ttft_attainment"] == 0.5 and row["gate_rate"] == 0.5
    assert row["num_errors"] == 1 and row["stall_fraction"] == pytest.approx(0.1)
    assert row["ttft_p50_s"] == pytest.approx(1.0) and row["ttft_p99_s"] == pytest.approx(2.96)  # [1, 1, 3] at the 99th percentile
    assert row["throughput_rps"] == pytest.approx(3 / 3.0)
    assert 2.9 < row["decision_ms_p99"] <= 3.0 and row["recompute_fraction"] == pytest.approx(0.1)


def test_best_static_is_the_best_measured_static_run_per_scale():
    rows = [{"method": "cachesmith", "slo_scale": 1.0, "qsa": 0.9}, {"method": "epic@0.15", "slo_scale": 1.0, "qsa": 0.4},
            {"method": "full_prefill", "slo_scale": 1.0, "qsa": 0.6}, {"method": "epic@0.15", "slo_scale": 2.0, "qsa": 0.7},
            {"method": "full_prefill", "slo_scale": 2.0, "qsa": 0.5}]
    best = best_static(rows)
    assert [(b["slo_scale"], b["config"], b["qsa"]) for b in best] == [(1.0, "full_prefill", 0.6), (2.0, "epic@0.15", 0.7)]
    assert all(b["method"] == "best_static" for b in best)
