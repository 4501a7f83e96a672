"""The planner's signal rules on the simulated grid: `cachesmith` (the robust rule: KV deviation unless
another signal is better under every known demand by its sampling error) against `cachesmith:passes`
(the most expected passes under the served mix) and the two fixed-signal ablations, each against
BestStatic, on the grid study of `cachesmith report` (PR, MSQ, VT, MV, MIX x six arrival patterns x
SLO 1-4x, the packaged outcome table and profile, 2 ms per decision so a rerun repeats row for row).

Prints the report's variant table (wins over BestStatic and at or above Full Prefill on the four
tasks' 96 settings, wins per task, the most it trails the better fixed-signal ablation, mean QSA)
and writes it as JSON (default `docs/bench/signal_rule_grid.json`). Rows are cached in `--rows`, so
a stopped run resumes.

    python -m benchmarks.signal_rule_grid --rows /tmp/signal-rule-grid.jsonl
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common.payload import command, emit

from cachesmith.bench.grid import GridConfig, run_grid, simulator_machine
from cachesmith.bench.results import variant_lines
from cachesmith.methods import default_methods
from cachesmith.calibration.packaged import PACKAGED_DIR

TABLE = Path("docs/results/outcomes-smollm2-135m-float32-cpu.json")
VARIANTS = ("cachesmith:passes", "cachesmith:kv_dev", "cachesmith:qci")
COLUMNS = ("method", "above_best_static", "at_or_above_full_prefill", "wins_per_task", "trail_pts", "mean_qsa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, required=True, help="grid rows JSONL (resumes)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/signal_rule_grid.json")
    args = ap.parse_args()
    factor, machine = simulator_machine(Path("docs/bench/sim_validation.json"), Path("docs/bench/machine.json"))
    config = GridConfig(num_requests=args.num_requests, studies=("grid",), decision_ms=2.0,
                        methods=tuple(default_methods()) + VARIANTS)
    rows = run_grid(TABLE, PACKAGED_DIR / TABLE.name.removeprefix("outcomes-"), factor, args.rows, config,
                    args.workers, machine=machine)
    table = [dict(zip(COLUMNS, (cell.strip("`") for cell in line))) for line in variant_lines(rows)]
    payload = {"rows": table, "num_requests": args.num_requests, "speed_factor": factor, "decision_ms": 2.0,
               "command": command()}

    def show() -> None:
        print("| " + " | ".join(COLUMNS) + " |")
        for r in table:
            print("| " + " | ".join(r[c] for c in COLUMNS) + " |")
    emit(payload, args.json, args.out, show)


if __name__ == "__main__":
    main()
