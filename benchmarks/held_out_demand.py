"""Is CacheSmith's trail behind its fixed-signal ablations a mechanism or the sample?

Two disjoint samples of measured outcomes exist: the evaluation table (A, about 60 instances per
task) and the demand table the packaged profile's demand curves come from (B, about 100 per task,
flips-only). This benchmark crosses them on the simulator's four-task grid (96 settings): the
planner's demand fit on one sample, requests drawn from the other (held out) or the same one
(in-sample). The shipped grid is "demand B, evaluate on A". If the default trails `:qci` or
`:kv_dev` by a mechanism, the trail shows in both held-out directions in the same settings; if it
is sampling noise, it moves with the samples, and the in-sample runs trail least.

Methods: CacheSmith's variants and the statics both tables measured (Full Prefill, Full Reuse,
CacheBlend at 15% and 30%: B measured no other preset), so "BestStatic" here is the best of
those. Decision times are pinned (`GridConfig.decision_ms`), so a rerun repeats row for row. Rows
per (demand, evaluation): `variant_lines`' wins, per-task wins, trail and mean QSA; then the
cross-fit estimate: per setting, the two held-out directions' QSA weighted by each evaluation
sample's instances of that task (the procedure "fit demand on one sample, serve the other",
judged on every instance once). Every run is cached under `--out-dir` (resumable); about 9
minutes on 2 cores. `--out` writes the JSON.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.common.payload import emit, print_table

from cachesmith.bench.grid import GridConfig, run_grid, simulator_machine
from cachesmith.bench.outcomes import OutcomeTable, demand_curves
from cachesmith.bench.results import FOUR_TASKS, arrival, fixed_signal_trail, settings, variant_lines
from cachesmith.model.assets import cachesmith_home
from cachesmith.planner import Profile
from cachesmith.calibration.packaged import PACKAGED_DIR

VARIANTS = ("cachesmith", "cachesmith:kv_dev", "cachesmith:qci", "cachesmith+task")
STATICS = ("full_prefill", "full_reuse", "cacheblend@0.15", "cacheblend@0.3")
COLUMNS = ["demand", "evaluated_on", "method", "above_best_static", "at_or_above_fp", "per_task", "trail_pts",
           "mean_qsa"]
SETTING_COLUMNS = ["task", "arrival", "slo_scale", "held_out_a", "held_out_b", "crossfit"]


def demand_profile(table: OutcomeTable, packaged: Path, out: Path) -> Path:
    """The packaged profile with its demand curves and entropy threshold refit on `table`."""
    curves, theta = demand_curves(table)
    replace(Profile.load(packaged), demand=curves, entropy_threshold=theta).save(out)
    return out


def grid_rows(args: argparse.Namespace, samples: dict[str, Path], profiles: dict[str, Path]) -> dict:
    """(demand, evaluated_on) -> the grid rows of the variants plus that evaluation's statics."""
    factor, machine = simulator_machine(args.validation, args.machine)
    base = dict(studies=("grid",), tasks=FOUR_TASKS, decision_ms=args.decision_ms, num_requests=args.num_requests)
    show = not args.json
    out = {}
    for ev, table in samples.items():
        statics = run_grid(table, profiles["B"], factor, args.out_dir / f"static_on_{ev}.jsonl",
                           GridConfig(methods=STATICS, **base), show_progress=show, machine=machine)
        for dem, profile in profiles.items():
            mine = run_grid(table, profile, factor, args.out_dir / f"demand_{dem}_on_{ev}.jsonl",
                            GridConfig(methods=VARIANTS, **base), show_progress=show, machine=machine)
            out[(dem, ev)] = statics + mine
    return out


def crossfit(rows: dict, counts: dict[str, dict[str, int]]) -> tuple[list[dict], list[dict]]:
    """Per setting, the default's trail in each held-out direction and pooled over both (each
    method's QSA weighted by the evaluated sample's instances of the task); returns those and the
    grid rows of the held-out "demand B, evaluate on A" run with every QSA replaced by the pooled."""
    qsa = {k: {key: {m: r["qsa"] for m, r in ms.items()} for key, ms in settings(rows[k]).items()}
           for k in (("B", "A"), ("A", "B"))}
    lines, pooled = [], {}
    for key, on_a in qsa[("B", "A")].items():
        on_b, wa, wb = qsa[("A", "B")][key], counts["A"][key[0]], counts["B"][key[0]]
        pooled[key] = {m: (wa * on_a[m] + wb * on_b[m]) / (wa + wb) for m in on_a}
        lines.append({"task": key[0], "arrival": key[1], "slo_scale": key[2], "held_out_a": trail(on_a),
                      "held_out_b": trail(on_b), "crossfit": trail(pooled[key])})
    rows_pooled = [{**r, "qsa": pooled[(r["task"], arrival(r), r["slo_scale"])][r["method"]]}
                   for r in rows[("B", "A")] if r["study"] == "grid"]
    return lines, rows_pooled


def trail(qsa: dict[str, float]) -> float:
    """Points the default trails the better of its two fixed-signal ablations (negative: leads)."""
    return 100 * fixed_signal_trail(qsa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", type=Path, default=Path("docs/results/outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--demand-table", type=Path,
                    default=Path("docs/results/demand-outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--validation", type=Path, default=Path("docs/bench/sim_validation.json"))
    ap.add_argument("--machine", type=Path, default=Path("docs/bench/machine.json"))
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--decision-ms", type=float, default=2.0)
    ap.add_argument("--num-worst", type=int, default=10, help="settings printed, by pooled trail")
    ap.add_argument("--out-dir", type=Path, default=cachesmith_home() / "held_out_demand")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    samples = {"A": args.table, "B": args.demand_table}
    for flag, path in (("--table", args.table), ("--demand-table", args.demand_table)):
        if not path.exists():
            raise SystemExit(f"error: {flag} {path}: no outcome table there (measure one: cachesmith outcomes)")
    tables = {k: OutcomeTable.load(p) for k, p in samples.items()}
    counts = {k: {t: len(t_.by_task(t)) for t in FOUR_TASKS} for k, t_ in tables.items()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    packaged = PACKAGED_DIR / args.table.name.removeprefix("outcomes-")
    profiles = {k: demand_profile(t, packaged, args.out_dir / f"profile_demand_{k}.json") for k, t in tables.items()}
    rows = grid_rows(args, samples, profiles)
    lines = [dict(zip(COLUMNS, [dem, ev, line[0].strip("`"), *line[1:]]))
             for (dem, ev), r in rows.items() for line in variant_lines(r)]
    per_setting, pooled = crossfit(rows, counts)
    lines += [dict(zip(COLUMNS, ["held out", "A+B", line[0].strip("`"), *line[1:]])) for line in variant_lines(pooled)]
    worst = sorted(per_setting, key=lambda r: -r["crossfit"])[:args.num_worst]
    summary = {k: {"max": max(r[k] for r in per_setting), "mean": statistics.fmean(r[k] for r in per_setting),
                   "num_over_2": sum(r[k] > 2 for r in per_setting)} for k in SETTING_COLUMNS[3:]}
    emit({"instances": counts, "decision_ms": args.decision_ms, "rows": lines, "trail_summary": summary,
          "settings": per_setting}, args.json, args.out,
         lambda: (print_table(lines, COLUMNS), print(), print_table(worst, SETTING_COLUMNS), print(), print(summary)))


if __name__ == "__main__":
    main()
