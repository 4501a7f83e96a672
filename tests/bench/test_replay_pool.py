"""`benchmarks/replay_confirm.py --pool`: earlier payloads summarized together, on hand-built rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import replay_confirm


def payload(path: Path, rows: list[tuple[int, str, float]], slo_scale: float = 2.0) -> Path:
    path.write_text(json.dumps({"num_requests": 96, "utilization": 0.7, "slo_scale": slo_scale, "rows": [
        {"setting": "gamma-cv3-u0.7", "seed": seed, "method": m, "qsa": q, "gate_rate": q, "ttft_attainment": 1.0}
        for seed, m, q in rows]}))
    return path


def test_pooled_means_cover_the_same_seeds_for_every_method(tmp_path):
    a = payload(tmp_path / "a.json", [(3, "cachesmith", 0.50), (3, "cacheblend@0.15", 0.48), (3, "epic@0.15", 0.60),
                                      (4, "cachesmith", 0.40), (4, "cacheblend@0.15", 0.43)])
    b = payload(tmp_path / "b.json", [(5, "cachesmith", 0.36), (5, "cacheblend@0.15", 0.20)])
    rows, shared = replay_confirm.pooled_rows([a, b])
    assert shared == {"num_requests": 96, "utilization": 0.7, "slo_scale": 2.0}
    assert {r["method"] for r in rows} == {"cachesmith", "cacheblend@0.15"}  # EPIC has seed 3 only
    assert len(rows) == 6
    summary = replay_confirm.summarize_setting(rows, "gamma-cv3-u0.7")
    assert summary["seeds"] == "3,4,5"
    assert summary["best_static"] == "cacheblend@0.15"
    assert summary["lead_pts"] == pytest.approx(100 * ((0.50 + 0.40 + 0.36) - (0.48 + 0.43 + 0.20)) / 3)


def test_a_later_payload_replaces_the_same_run_and_other_settings_are_refused(tmp_path):
    a = payload(tmp_path / "a.json", [(3, "cachesmith", 0.50), (3, "cacheblend@0.15", 0.48)])
    rerun = payload(tmp_path / "rerun.json", [(3, "cachesmith", 0.55)])
    rows, _ = replay_confirm.pooled_rows([a, rerun])
    assert {r["method"]: r["qsa"] for r in rows} == {"cachesmith": 0.55, "cacheblend@0.15": 0.48}
    other = payload(tmp_path / "other.json", [(4, "cachesmith", 0.5), (4, "cacheblend@0.15", 0.4)], slo_scale=3.0)
    with pytest.raises(SystemExit, match="slo_scale"):
        replay_confirm.pooled_rows([a, other])
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="bad.json is not a replay_confirm payload"):
        replay_confirm.pooled_rows([a, tmp_path / "bad.json"])
