"""The GPU forecast (`benchmarks/gpu_forecast.py`, `docs/bench/gpu_forecast.json`) beside a GPU
check's measured rows, so the first run on a GPU grades it.

In: the check's rows (`benchmarks/gpu_check.py`), torch's name for its GPU, the forecast payload.
Out: each measured row the forecast has, with the forecast's figure beside it (`forecast_ms`, and
`forecast_eager_ms` for the eager run of a reuse row; `forecast_tokens_per_s` for decode) and
`forecast_error` (measured / forecast - 1); and a summary: which forecast GPU, rows graded, the
median |error|. A GPU the forecast has no specification for is not graded.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

FORECAST = Path(__file__).resolve().parents[2] / "docs/bench/gpu_forecast.json"
ROW_NAMES = {"full_reuse": "full_reuse", "cacheblend@0.15": "cacheblend"}  # the check's method -> forecast row


def forecast_device(gpu_name: str) -> str | None:
    """The forecast's GPU for torch's device name ("NVIDIA H100 80GB HBM3" -> "H100 SXM")."""
    if "H200" in gpu_name:
        return "H200"
    if "H100" in gpu_name:
        return "H100 SXM"
    return None


def beside_forecast(rows: list[dict], gpu_name: str, path: Path = FORECAST) -> dict:
    if not Path(path).exists():
        return {"graded": 0, "why": f"no forecast at {path}"}
    device = forecast_device(gpu_name)
    if device is None:
        return {"graded": 0, "why": f"the forecast has no specification for {gpu_name!r}"}
    forecast = [r for r in json.loads(Path(path).read_text(encoding="utf-8"))["rows"] if r["device"] == device]
    errors = [e for row in rows for e in _grade(row, forecast)]
    return {"device": device, "graded": len(errors),
            "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None}


def _find(forecast: list[dict], name: str, tokens: int, graphs) -> dict | None:
    return next((r for r in forecast if r["row"] == name and r["tokens"] == tokens and r["graphs"] == graphs), None)


def _grade(row: dict, forecast: list[dict]) -> list[float]:
    """The row's errors against the forecast, its forecast fields added; [] where it has none."""
    pairs = []  # (measured field, forecast row, forecast field, field written)
    if row.get("leg") == "prefill" and "engine_ms" in row:
        pairs.append(("engine_ms", _find(forecast, "full_prefill", int(row["case"]), "-"), "ms", "forecast_ms"))
    elif row.get("leg") == "reuse" and row.get("path") == "direct" and row.get("method") in ROW_NAMES:
        name, tokens = ROW_NAMES[row["method"]], row.get("context_tokens")
        pairs.append(("ms", _find(forecast, name, tokens, True), "ms", "forecast_ms"))
        pairs.append(("eager_ms", _find(forecast, name, tokens, False), "ms", "forecast_eager_ms"))
    elif row.get("leg") == "decode" and "engine_tokens_per_s" in row:
        streams, tokens = row.get("streams"), row.get("context_tokens")
        pairs.append(("engine_tokens_per_s", _find(forecast, f"decode x{streams}", tokens, True),
                      "tokens_per_s", "forecast_tokens_per_s"))
    errors = []
    for measured, found, field, written in pairs:
        if found is not None and row.get(measured):
            row[written] = found[field]
            errors.append(row[measured] / found[field] - 1)
    if errors:
        row["forecast_error"] = errors[0]
    return errors
