"""Metrics of one run (paper §6.1) and the BestStatic oracle.

In: the per-request records of one (method, SLO scale) run and the engine's stats. Out: a summary
row with `method`, `qsa`, `ttft_attainment`, `gate_rate`, `ttft_p50_s`, `ttft_p90_s`,
`ttft_p99_s`, `throughput_rps`, `stall_fraction`, `decision_ms_p99` and counts. Rates are over
every request of the trace; a refused request counts as neither on time nor passed.
BestStatic: per SLO scale, the static method with the highest measured QSA (it is granted the SLO,
the arrival pattern and the outcome; only the task is withheld, which a single setting can't).
"""
from __future__ import annotations

import numpy as np

from cachesmith.engine import EngineStats
from cachesmith.methods import parse_method

KEYS = ("method", "qsa", "ttft_attainment", "gate_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
        "throughput_rps", "stall_fraction", "decision_ms_p99")


def summarize(method: str, slo_scale: float, records: list[dict], stats: EngineStats) -> dict:
    n = len(records)
    served = [r for r in records if r["error"] is None]
    ttfts = np.array([r["ttft_s"] for r in served]) if served else np.array([np.nan])
    if served:
        start = min(r["arrival_s"] for r in served)
        span = max(r["first_token_s"] for r in served) - start
    else:
        span = 0.0
    return {
        "method": method, "slo_scale": slo_scale,
        "qsa": sum(r["is_qsa"] for r in records) / n,
        "ttft_attainment": sum(r["is_on_time"] for r in records) / n,
        "gate_rate": sum(r["is_passed"] is True for r in records) / n,
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "throughput_rps": len(served) / span if span > 0 else 0.0,
        "stall_fraction": stats.stall_s / stats.busy_s if stats.busy_s > 0 else 0.0,
        "decision_ms_p99": float(np.percentile(stats.decision_ms, 99)) if stats.decision_ms else 0.0,
        "num_requests": n, "num_errors": n - len(served), "num_batches": stats.num_batches,
        "mean_batch_size": len(served) / stats.num_batches if stats.num_batches else 0.0,
        "recompute_fraction": (sum(r["num_recomputed"] for r in served) /
                               max(1, sum(r["num_context_tokens"] for r in served))),
        "num_monitor_replans": stats.num_monitor_replans,
        "num_partial_batches": stats.num_partial_batches,
    }


def best_static(rows: list[dict]) -> list[dict]:
    """One `best_static` row per SLO scale: the static method with the highest QSA (ties: the
    earlier in the method list), labelled with the method it stands for."""
    out = []
    for scale in sorted({r["slo_scale"] for r in rows}):
        static = [r for r in rows if r["slo_scale"] == scale and parse_method(r["method"]).is_static]
        if static:
            best = max(static, key=lambda r: r["qsa"])
            out.append({**best, "method": "best_static", "config": best["method"]})
    return out
