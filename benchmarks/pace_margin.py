"""Does sizing plans for a slower pace than the mean pay on a machine whose pace swings?

The grid study's four tasks on the simulator, its machine made noisy: each batch runs at
exp(x) x its simulated time, x an AR(1) series of std `--sigmas` and lag-1 correlation `--corr`
(`bench.sim_executor.MachineNoise`; replays on these shared machines swung 0.5x-3.6x within
minutes). Per noise level the static methods run once; CacheSmith and its two fixed-signal variants
run once per `--zs`, the planner's `pace_margin_z` (plans fit the budget at the pace `z` spreads of
the pace book's recent price errors above its mean). Rows: wins over BestStatic and at or above Full
Prefill on the 96 settings, wins per task, the most CacheSmith trails the better fixed-signal
variant, mean QSA. Every simulated run is cached under `--out-dir` (resumable); `--out` writes the
JSON. About 3 minutes per noise level for the statics and 1.5 per z on 2 cores.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common.payload import emit, print_table

from cachesmith.bench.grid import GridConfig, run_grid, simulator_machine
from cachesmith.bench.results import variant_lines
from cachesmith.methods import default_methods
from cachesmith.model.assets import cachesmith_home
from cachesmith.calibration.packaged import PACKAGED_DIR

VARIANTS = ("cachesmith", "cachesmith:kv_dev", "cachesmith:qci")
COLUMNS = ["sigma", "z", "method", "above_best_static", "at_or_above_fp", "per_task", "trail_pts", "mean_qsa"]


def study(args: argparse.Namespace) -> list[dict]:
    factor, machine = simulator_machine(args.validation, args.machine)
    profile = PACKAGED_DIR / args.table.name.removeprefix("outcomes-")
    statics = tuple(m for m in default_methods() if not m.startswith("cachesmith"))
    out = []
    for sigma in args.sigmas:
        base = dict(studies=("grid",), tasks=("pr", "msq", "vt", "mv"), noise_sigma=sigma, noise_corr=args.corr,
                    num_requests=args.num_requests)
        rows = run_grid(args.table, profile, factor, args.out_dir / f"static_s{sigma}_c{args.corr}.jsonl",
                        GridConfig(methods=statics, **base), show_progress=not args.json, machine=machine)
        for z in args.zs:
            mine = run_grid(args.table, profile, factor, args.out_dir / f"cs_s{sigma}_c{args.corr}_z{z}.jsonl",
                            GridConfig(methods=VARIANTS, pace_margin_z=z, **base), show_progress=not args.json,
                            machine=machine)
            for line in variant_lines(rows + mine):
                out.append(dict(zip(COLUMNS, [sigma, z, line[0].strip("`"), *line[1:]])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", type=Path, default=Path("docs/results/outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--validation", type=Path, default=Path("docs/bench/sim_validation.json"))
    ap.add_argument("--machine", type=Path, default=Path("docs/bench/machine.json"))
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.15, 0.3])
    ap.add_argument("--corr", type=float, default=0.7)
    ap.add_argument("--zs", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--out-dir", type=Path, default=cachesmith_home() / "pace_margin")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.table.exists():
        raise SystemExit(f"error: --table {args.table}: no outcome table there (measure one: cachesmith outcomes)")
    rows = study(args)
    emit({"corr": args.corr, "rows": rows}, args.json, args.out, lambda: print_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
