"""`cachesmith report` end to end on a hand-built table and profile (a reduced grid, no model)."""
from __future__ import annotations

import json

from cachesmith.bench.evaluation import ReportInputs, make_report
from cachesmith.bench.grid import GridConfig
from cachesmith.bench.results import best_static_configs, comparisons, win_summary
from cachesmith.cli import main
from tests.bench.sim_helpers import table
from tests.planner.synthetic_profile import make_profile

METHODS = ("cachesmith", "full_prefill", "cacheblend@0.3", "epic@0.15")


def small_grid() -> GridConfig:
    return GridConfig(num_requests=12, studies=("grid", "band", "bandwidth"), methods=METHODS,
                      arrivals=(("poisson", 1.0, 0.7), ("gamma", 3.0, 0.7)), slo_scales=(1.0, 2.0),
                      bandwidths=(10.0, 0.3))


def test_report_writes_markdown_figures_and_summaries_from_the_rows(tmp_path):
    table().save(tmp_path / "outcomes-x.json")
    make_profile().save(tmp_path / "profile.json")
    row = {"setting": "mix-poisson", "seeds": "0,1", "method": "cachesmith", "qsa_replay": 0.5, "qsa_sim": 0.52,
           "qsa_diff_pts": 2.0, "p99_replay_s": 4.0, "p99_sim_s": 4.2, "p99_rel_err": 0.05, "gate_replay": 0.6,
           "gate_sim": 0.6, "att_replay": 0.9, "att_sim": 0.9, "is_within": True}
    noise = {**row, "setting": "mix-gamma (replay again)", "seeds": "0", "p99_sim_s": 4.8, "p99_rel_err": 0.2,
             "is_within": False}
    cross = {**row, "setting": "mix-poisson (left out)"}
    (tmp_path / "val.json").write_text(json.dumps({"speed_factor": 1.0, "rows": [row], "replay_noise": [noise],
                                                   "cross_validated": [cross],
                                                   "machine": {"paces": {"qci/1/1": 0.7}, "reuse_per_row": 0.2}}))
    out = tmp_path / "docs" / "results.md"
    inputs = ReportInputs(tmp_path / "outcomes-x.json", tmp_path / "profile.json", 1.0, tmp_path / "val.json",
                          tmp_path / "rows.jsonl", out, small_grid(), num_workers=1,
                          machine={"paces": {"qci/1/1": 0.7}, "reuse_per_row": 0.2})
    make_report(inputs, show_progress=False)
    text = out.read_text()
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 2 * 2 * 4 + 9 + 3 * 2 * 4
    comps = comparisons(rows)
    assert len(comps) == 5 * 2 * 2
    vs = win_summary(comps, "best_static")
    assert f"higher QSA in **{vs['num_wins']} of {vs['num_settings']}** settings" in text
    for c in comps:  # BestStatic is one configuration per (arrival, SLO), never above the band
        assert c["band_min"] <= c["best_static"] <= c["band_max"]
        assert c["best_static_config"] == best_static_configs(rows)[(c["arrival"], c["slo_scale"])]
    for png in ("qsa_vs_slo", "accuracy_vs_attainment", "p99_ttft", "bandwidth", "band"):
        path = out.parent / "results" / f"{png}.png"
        assert path.stat().st_size > 5000 and f"(results/{png}.png)" in text
    assert "| mix-poisson | 0,1 | cachesmith | 50% | 52% | +2.0 |" in text
    assert "| mix-poisson (left out) | 0,1 | cachesmith |" in text
    assert "| mix-gamma (replay again) | 0 | cachesmith | 50% | 52% | +2.0 | 4.00 | 4.80 | +20.0% |" in text
    assert "qci/1/1 0.70x; plus 0.20x the cost of recomputing a row" in text
    assert "## Where these results differ from the paper's, and why" in text


def test_report_cli_names_a_missing_table(tmp_path, capsys):
    assert main(["report", "--table", str(tmp_path / "none.json")]) == 2
    assert "no outcome table there" in capsys.readouterr().err


def test_outcomes_cli_refuses_a_bad_count_before_loading_anything(capsys):
    assert main(["outcomes", "--num-instances", "0"]) == 2
    assert "--num-instances 0 must be >= 1" in capsys.readouterr().err


def test_best_static_and_wins_match_counts_made_by_hand():
    """Rows built by hand, BestStatic and the win counts worked out here without the report's code."""
    qsa = {  # (arrival, slo) -> task -> method -> qsa
        ("poisson", 1.0): {"pr": {"cachesmith": 0.9, "full_prefill": 0.8, "cacheblend@0.15": 0.5},
                           "msq": {"cachesmith": 0.4, "full_prefill": 0.6, "cacheblend@0.15": 0.45},
                           "vt": {"cachesmith": 0.3, "full_prefill": 0.3, "cacheblend@0.15": 0.2},
                           "mv": {"cachesmith": 0.7, "full_prefill": 0.1, "cacheblend@0.15": 0.6}},
        ("gamma", 2.0): {"pr": {"cachesmith": 0.5, "full_prefill": 0.2, "cacheblend@0.15": 0.45},
                         "msq": {"cachesmith": 0.5, "full_prefill": 0.1, "cacheblend@0.15": 0.5},
                         "vt": {"cachesmith": 0.1, "full_prefill": 0.0, "cacheblend@0.15": 0.3},
                         "mv": {"cachesmith": 0.6, "full_prefill": 0.3, "cacheblend@0.15": 0.2}}}
    rows = [{"study": "grid", "task": t, "pattern": "poisson" if slo == 1.0 else "gamma", "cv": 1.0 if slo == 1.0
             else 2.0, "utilization": 0.7, "slo_scale": slo, "method": m, "qsa": q}
            for (_, slo), tasks in qsa.items() for t, ms in tasks.items() for m, q in ms.items()]
    # by hand: Poisson means FP 0.45 > CB 0.4375; Gamma CB 0.3625 > FP 0.15
    assert best_static_configs(rows) == {("Poisson u0.7", 1.0): "full_prefill", ("Gamma CV2", 2.0): "cacheblend@0.15"}
    summary = win_summary(comparisons(rows), "best_static")
    # by hand: Poisson against FP: pr W, msq L, vt T, mv W; Gamma against CB: pr W, msq T, vt L, mv W
    assert (summary["num_wins"], summary["num_ties"], summary["num_losses"], summary["num_settings"]) == (4, 2, 2, 8)
    fp = win_summary(comparisons(rows), "full_prefill")
    # by hand against full prefill: poisson pr W, msq L, vt T, mv W; gamma W on all four
    assert (fp["num_wins"], fp["num_ties"], fp["num_losses"]) == (6, 1, 1)
