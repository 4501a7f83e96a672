"""How well each signal rule picks the signal a request needs less coverage with (issue #18),
held out: the rules are fit on the profile's demand instances, scored on the outcome table's (seeds
disjoint). Oracle per request and anchor depth: the signal with the lower minimum sufficient
coverage; requests where the two tie (or neither passes) say nothing and are not counted.

Rules: `entropy` (the paper's: kv_dev if the layer-0 QCI entropy > theta, theta fit on the demand
instances), `passes` (the planner's default: the signal whose served-mix demand passes more
requests over the planner's coverage range, one answer for every request), `passes+task` (the same
with the request's task's own curves), and `kv_dev` / `qci` always. Rows per task and depth:
requests where the signals differ, and each rule's accuracy on them. `--json` prints the payload.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, load_profile, print_table  # noqa: E402

from cachesmith.bench.outcomes import OutcomeTable, demand  # noqa: E402
from cachesmith.planner.demand import COVERAGE_GRID, DemandModel  # noqa: E402

RANGE = (COVERAGE_GRID >= 0.05 - 1e-9) & (COVERAGE_GRID <= 0.5 + 1e-9)  # the planner's r_min..r_max


def preferred(model: DemandModel, depth: int, task: str | None) -> str:
    """The signal whose demand passes more requests, averaged over the planner's coverage range."""
    mass = {s: float(model.cdf(s, depth, task)[RANGE].mean()) for s in ("kv_dev", "qci")}
    return max(mass, key=mass.get)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", type=Path, default=Path("docs/results/outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--profile", type=Path, default=None, help="default: measured, else the packaged one")
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
    emit({"profile": source, "entropy_threshold": profile.entropy_threshold, "rows": rows}, args.json, args.out,
         lambda: print_table(rows, ["task", "depth", "requests", "differ", "entropy", "passes", "passes+task",
                                    "kv_dev", "qci"]))


if __name__ == "__main__":
    main()
