"""`cachesmith outcomes` and `cachesmith report`: the evaluation's commands (thin layers over
`bench.outcomes` and `bench.evaluation`).

  cachesmith outcomes [--num-instances 80]      (offline, resumable: verdicts cached as JSONL)
  cachesmith outcomes --extend TABLE            (only the plans the table lacks)
  cachesmith outcomes --append TABLE --seed S   (more instances into a saved table)
  cachesmith report [--table T --validation V --out docs/results.md]   (grid resumable)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cachesmith.errors import CachesmithError

PACKAGED_TABLE = Path("docs/results/outcomes-smollm2-135m-float32-cpu.json")


def _outcomes(args: argparse.Namespace) -> int:
    from cachesmith.bench.outcomes import default_table_path, measure_table
    from cachesmith.pipeline import RagPipeline

    if args.num_instances < 1:
        raise CachesmithError(f"--num-instances {args.num_instances} must be >= 1")
    pipe = RagPipeline(args.model, args.device, args.dtype)
    if args.extend is not None:
        return _extend(pipe, args)
    if args.append is not None:
        return _append(pipe, args)
    out = args.out or default_table_path(pipe)
    table = measure_table(pipe, _instances(args), out.with_suffix(".evals.jsonl"), is_flips_only=args.flips_only)
    table.save(out)
    print(f"{out}: {len(table.outcomes)} instances")
    if args.demand_into is not None:
        _write_demand(table, args.demand_into)
    return 0


def _instances(args: argparse.Namespace) -> list:
    """(seed, instance) for --num-instances seeds from --seed of --task."""
    from cachesmith.workloads.tasks import generate

    return [(args.seed + i, generate(args.task, args.seed + i)) for i in range(args.num_instances)]


def _evals_cache(table_path: Path) -> Path:
    """A saved table's verdict cache: resumable, and not beside a committed table."""
    from cachesmith.model.assets import cachesmith_home

    return cachesmith_home() / "outcomes" / f"{table_path.stem}.evals.jsonl"


def _extend(pipe, args: argparse.Namespace) -> int:
    """Measure the fixed plans a saved table lacks; rewrite its demand where asked."""
    from cachesmith.bench.outcomes import OutcomeTable, extend_table

    if not args.extend.exists():
        raise CachesmithError(f"--extend {args.extend}: no outcome table there")
    table = OutcomeTable.load(args.extend)
    added = extend_table(pipe, table, _evals_cache(args.extend))
    table.save(args.extend)
    print(f"{args.extend}: {added} verdicts added over {len(table.outcomes)} instances")
    if args.demand_into is not None:
        _write_demand(table, args.demand_into)
    return 0


def _append(pipe, args: argparse.Namespace) -> int:
    """Measure new instances into a saved table (its own kind: full or flips-only)."""
    from cachesmith.bench.outcomes import OutcomeTable, append_table

    if not args.append.exists():
        raise CachesmithError(f"--append {args.append}: no outcome table there")
    added = append_table(pipe, args.append, _instances(args), _evals_cache(args.append))
    table = OutcomeTable.load(args.append)
    print(f"{args.append}: {added} instances added, {len(table.outcomes)} in all")
    if args.demand_into is not None:
        _write_demand(table, args.demand_into)
    return 0


def _write_demand(table, path: Path) -> None:
    """The planner's demand curves (served mix and per task) and entropy threshold from `table`,
    written into the profile at `path` (its costs are kept)."""
    from dataclasses import replace

    from cachesmith.bench.outcomes import demand_curves
    from cachesmith.planner import Profile

    profile = Profile.load(path)
    curves, theta = demand_curves(table)
    replace(profile, demand=curves, entropy_threshold=theta).save(path)
    tasks = sorted({c.task for c in curves if c.task})
    print(f"{path}: demand of {len(table.outcomes)} instances (served mix" + (f"; {', '.join(tasks)}" if tasks else "")
          + f"), entropy threshold {theta:.3f}")


def _report(args: argparse.Namespace) -> int:
    from cachesmith.bench.evaluation import ReportInputs, make_report
    from cachesmith.bench.grid import GridConfig, simulator_machine
    from cachesmith.calibration.packaged import PACKAGED_DIR

    table = args.table
    if not table.exists():
        raise CachesmithError(f"--table {table}: no outcome table there (measure one: cachesmith outcomes)")
    profile = args.profile or PACKAGED_DIR / table.name.removeprefix("outcomes-")
    measured_factor, machine = simulator_machine(args.validation, args.machine)
    if args.machine is not None and args.machine.exists():
        print(f"simulator machine: {args.machine}", file=sys.stderr)
    factor = args.speed_factor if args.speed_factor is not None else measured_factor
    grid = GridConfig(num_requests=args.num_requests, studies=tuple(args.studies), decision_ms=args.decision_ms)
    rows = args.rows or args.out.parent / "results" / "grid.jsonl"
    path = make_report(ReportInputs(table, profile, factor, args.validation, rows, args.out, grid, args.workers,
                                    machine))
    print(f"wrote {path} (figures in {path.parent / 'results'})", file=sys.stderr)
    return 0


def add_parsers(sub, add_model_args) -> None:
    out = sub.add_parser("outcomes", help="measure the simulator's outcome tables with the real engine")
    add_model_args(out)
    out.add_argument("--num-instances", type=int, default=80, help="MIX instances (the four tasks in turn)")
    out.add_argument("--task", default="mix")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--out", type=Path, default=None, help="default $CACHESMITH_HOME/outcomes/<model>.json")
    out.add_argument("--demand-into", type=Path, default=None, metavar="PROFILE",
                     help="also write these instances' demand curves (served mix and per task) into this "
                          "profile; use seeds disjoint from the outcome tables the grid draws from")
    out.add_argument("--flips-only", action="store_true",
                     help="demand instances: full prefill, full reuse and the flips, no baseline presets "
                          "(the simulator cannot serve static methods from such a table)")
    out.add_argument("--extend", type=Path, default=None, metavar="TABLE",
                     help="measure only the fixed plans this saved table's instances lack (after the plan "
                          "list grew) and save it back; with --demand-into, rewrite that profile's demand")
    out.add_argument("--append", type=Path, default=None, metavar="TABLE",
                     help="measure --num-instances instances from --seed into this saved table (skipping "
                          "those it holds), saving it after each; with --demand-into, rewrite that profile's demand")
    out.set_defaults(func=_outcomes)
    rep = sub.add_parser("report", help="the paper's grid and ablations on the simulator -> docs/results.md")
    rep.add_argument("--table", type=Path, default=PACKAGED_TABLE)
    rep.add_argument("--profile", type=Path, default=None, help="default: the packaged profile of the table's model")
    rep.add_argument("--speed-factor", type=float, default=None,
                     help="default: the validation run's (its plan-family paces and reuse cost are used too)")
    rep.add_argument("--validation", type=Path, default=Path("docs/bench/sim_validation.json"))
    rep.add_argument("--machine", type=Path, default=Path("docs/bench/machine.json"),
                     help="speed factor and plan-family paces refit against the profile on the recorded "
                          "replays (benchmarks/cost_model.py --full --machine); overrides the validation's")
    rep.add_argument("--rows", type=Path, default=None, help="grid rows JSONL (resumable cache)")
    rep.add_argument("--out", type=Path, default=Path("docs/results.md"))
    rep.add_argument("--num-requests", type=int, default=200)
    rep.add_argument("--studies", nargs="+", default=["grid", "components", "signals", "band", "bandwidth"],
                     choices=["grid", "components", "signals", "band", "bandwidth"])
    rep.add_argument("--workers", type=int, default=2)
    rep.add_argument("--decision-ms", type=float, default=None,
                     help="every scheduling and plan decision costs this many ms of simulated time, so a rerun "
                          "repeats row for row (default: their measured wall time); rows are cached by run, so "
                          "give a fresh --rows file")
    rep.set_defaults(func=_report)
