"""A GPU check's measured rows graded against the forecast (`benchmarks/common/forecast_rows.py`)."""
from __future__ import annotations

import json

import pytest

from benchmarks.common.forecast_rows import beside_forecast, forecast_device

FORECAST = {"rows": [
    {"device": "H100 SXM", "row": "full_prefill", "tokens": 2048, "graphs": "-", "ms": 50.0},
    {"device": "H100 SXM", "row": "full_reuse", "tokens": 2048, "graphs": True, "ms": 4.0},
    {"device": "H100 SXM", "row": "full_reuse", "tokens": 2048, "graphs": False, "ms": 20.0},
    {"device": "H100 SXM", "row": "decode x8", "tokens": 2048, "graphs": True, "tokens_per_s": 1000.0},
    {"device": "H200", "row": "full_prefill", "tokens": 2048, "graphs": "-", "ms": 40.0}]}


@pytest.fixture()
def forecast(tmp_path):
    path = tmp_path / "gpu_forecast.json"
    path.write_text(json.dumps(FORECAST))
    return path


def test_each_measured_row_gets_its_forecast_and_error(forecast):
    rows = [{"leg": "prefill", "case": "2048", "engine_ms": 60.0},
            {"leg": "reuse", "path": "direct", "method": "full_reuse", "context_tokens": 2048, "ms": 5.0,
             "eager_ms": 30.0},
            {"leg": "reuse", "path": "store", "method": "full_reuse", "context_tokens": 2048, "ms": 9.0},
            {"leg": "decode", "streams": 8, "context_tokens": 2048, "engine_tokens_per_s": 800.0},
            {"leg": "prefill", "case": "8192", "engine_ms": 200.0}]
    summary = beside_forecast(rows, "NVIDIA H100 80GB HBM3", forecast)
    assert summary["device"] == "H100 SXM" and summary["graded"] == 4
    assert rows[0]["forecast_ms"] == 50.0 and rows[0]["forecast_error"] == pytest.approx(0.2)
    assert (rows[1]["forecast_ms"], rows[1]["forecast_eager_ms"]) == (4.0, 20.0)
    assert rows[1]["forecast_error"] == pytest.approx(0.25)
    assert "forecast_ms" not in rows[2] and "forecast_ms" not in rows[4]  # the store path; no 8K forecast
    assert rows[3]["forecast_tokens_per_s"] == 1000.0 and rows[3]["forecast_error"] == pytest.approx(-0.2)
    assert summary["median_abs_error"] == pytest.approx(0.225)  # of 0.2, 0.25, 0.5, 0.2


def test_a_gpu_without_a_specification_or_a_missing_forecast_grades_nothing(forecast, tmp_path):
    rows = [{"leg": "prefill", "case": "2048", "engine_ms": 60.0}]
    assert beside_forecast(rows, "NVIDIA A100-SXM4-80GB", forecast)["graded"] == 0
    assert "no forecast" in beside_forecast(rows, "NVIDIA H200", tmp_path / "none.json")["why"]
    assert "forecast_ms" not in rows[0]
    assert forecast_device("NVIDIA H200 NVL") == "H200"
