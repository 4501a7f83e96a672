"""How well each signal rule picks the signal a request needs less coverage with,
held out: the rules are fit on the profile's demand instances, scored on the outcome table's (seeds
disjoint). Oracle per request and anchor depth: the signal with the lower minimum sufficient
coverage; requests where the two tie (or neither passes) say nothing and are not counted.

Rules: `entropy` (the paper's: kv_dev if the layer-0 QCI entropy > theta, theta fit on the demand
instances), `passes` (the planner's default: the signal whose served-mix demand passes more
requests over the planner's coverage range, one answer for every request), `passes+task` (the same
with the request's task's own curves), and `kv_dev` / `qci` always. Rows per task and depth:
requests where the signals differ, and each rule's accuracy on them.

`noise` rows: how far two draws of one task's instances disagree on which signal is better. Per task
and coverage, the paired difference in pass rate between QCI at rank depth 6 or 15 and CacheBlend's
KV deviation at rank depth 1 (the default's usual plan), on the profile's instances (`--profile-table`)
and on the outcome table's, each with a 95% bootstrap interval over instances. Where the two draws'
intervals both straddle 0, no choice fit on one draw can be held to a few points on the other.
`--json` prints the payload.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.common.payload import emit, print_table
from benchmarks.common.profile import load_profile

from cachesmith.bench.outcomes import OutcomeTable, demand
from cachesmith.planner.demand import COVERAGE_GRID, DemandModel

NOISE_COVERAGES = (0.10, 0.15, 0.30)  # the shallow family's measured coverages in the planner's range
NOISE_DEPTHS = (6, 15)
RANGE = (COVERAGE_GRID >= 0.05 - 1e-9) & (COVERAGE_GRID <= 0.5 + 1e-9)  # the planner's r_min..r_max


def preferred(model: DemandModel, depth: int, task: str | None) -> str:
    """The signal whose demand passes more requests, averaged over the planner's coverage range."""
    mass = {s: float(model.cdf(s, depth, task)[RANGE].mean()) for s in ("kv_dev", "qci")}
    return max(mass, key=mass.get)


def paired_interval(diffs: np.ndarray, seed: int = 0, num_draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the mean of per-instance paired differences."""
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), (num_draws, len(diffs)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def noise_rows(tables: dict[str, OutcomeTable]) -> list[dict]:
    """Per (draw, task, coverage, QCI depth): the pass-rate difference QCI - KV deviation at depth 1."""
    rows = []
    for draw, table in tables.items():
        for task in ("pr", "msq", "vt", "mv"):
            outs = table.by_task(task)
            for coverage in NOISE_COVERAGES:
                shallow = np.array([table.passes(o, "kv_dev", 1, 0, coverage) for o in outs], float)
                for depth in NOISE_DEPTHS:
                    deep = np.array([table.passes(o, "qci", depth - 1, 1, coverage) for o in outs], float)
                    lo, hi = paired_interval(deep - shallow)
                    rows.append({"draw": draw, "task": task, "coverage": coverage, "qci_depth": depth,
                                 "requests": len(outs), "diff_pts": 100 * float((deep - shallow).mean()),
                                 "ci_lo_pts": 100 * lo, "ci_hi_pts": 100 * hi})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", type=Path, default=Path("docs/results/outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--profile", type=Path, default=None, help="default: measured, else the packaged one")
    ap.add_argument("--profile-table", type=Path,
                    default=Path("docs/results/demand-outcomes-smollm2-135m-float32-cpu.json"),
                    help="the profile's own instances, for the noise rows (skipped if missing)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    table = OutcomeTable.load(args.table)
    profile, source = load_profile(args.profile)
    model = DemandModel(profile.demand)
    depths = sorted({int(k.split("/")[1]) for k in table.outcomes[0].flips})
    rows = []
    for task in ("pr", "msq", "vt", "mv", "mix"):
        outs = table.by_task(task)
        for depth in depths:
            hits = {r: [] for r in ("entropy", "passes", "passes+task", "kv_dev", "qci")}
            for o in outs:
                kv, qci = demand(o, f"kv_dev/{depth}")[0], demand(o, f"qci/{depth}")[0]  # minimum sufficient
                if kv == qci:
                    continue
                oracle = "kv_dev" if kv < qci else "qci"
                picks = {"entropy": "kv_dev" if o.entropy > profile.entropy_threshold else "qci",
                         "passes": preferred(model, depth, None), "passes+task": preferred(model, depth, o.task),
                         "kv_dev": "kv_dev", "qci": "qci"}
                for rule, pick in picks.items():
                    hits[rule].append(pick == oracle)
            rows.append({"task": task, "depth": depth, "requests": len(outs), "differ": len(hits["kv_dev"]),
                         **{rule: float(np.mean(v)) if v else None for rule, v in hits.items()}})
    draws = {"outcomes": table}
    if args.profile_table.exists():
        draws = {"profile": OutcomeTable.load(args.profile_table), **draws}
    else:
        print(f"no profile instances at {args.profile_table}: noise rows from the outcome table only",
              file=sys.stderr)
    noise = noise_rows(draws)

    def show() -> None:
        print_table(rows, ["task", "depth", "requests", "differ", "entropy", "passes", "passes+task", "kv_dev", "qci"])
        print_table(noise, ["draw", "task", "coverage", "qci_depth", "requests", "diff_pts", "ci_lo_pts", "ci_hi_pts"])
    emit({"profile": source, "entropy_threshold": profile.entropy_threshold, "rows": rows, "noise": noise},
         args.json, args.out, show)


if __name__ == "__main__":
    main()
