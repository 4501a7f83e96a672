"""How long `cachesmith profile --workload` takes: the label-free (fidelity gate) demand profile of a
workload file the profile has never seen, on the packaged model.

`--max-coverage 1.0 0.5` times the full search and the censored one (flips above 50% recorded at
full prefill's) on the same requests, each from its own verdict cache, and counts the pass rates up
to the smaller cap on which they agree.

Default workload: `outside_workload.py`'s two tasks (a lookup among look-alikes, a short
description), with the gold removed, since the point is an operator's file without labels. Prints
the wall time, the time per request and the time 50 requests would take at that rate (the bar:
15 minutes on 2 cores), and writes the JSON with the command, commit and CPU (default
`docs/bench/workload_profile.json`). Verdicts are cached under `--cache` (default: a fresh folder), so a stopped run resumes.

    python -m benchmarks.workload_profile --num-requests 8
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


import torch
from benchmarks.common.payload import command, commit, cpu, emit, print_table
from benchmarks.outside_workload import outside_requests

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.profiler.workload import run_workload_demand
from cachesmith.workloads.corpus import load_corpus

BAR_REQUESTS, BAR_MINUTES = 50, 15.0


def label_free_file(path: Path, num_requests: int, seed: int) -> Path:
    """`outside_workload.py`'s requests without their gold answers."""
    lines = outside_requests(load_corpus(), num_requests, seed)
    path.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "gold"}) + "\n" for line in lines))
    return path


def agreement(first, other, max_coverage: float) -> str:
    """How many (curve, coverage) pass rates up to `max_coverage` the two profiles share."""
    grid = [round(0.05 * i, 2) for i in range(21) if 0.05 * i <= max_coverage + 1e-9]
    mine = {(c.task, c.signal, c.rank_depth): c for c in other.demand}
    same = total = 0
    for curve in first.demand:
        ref, got = curve.pass_rate(grid), mine[(curve.task, curve.signal, curve.rank_depth)].pass_rate(grid)
        same += int(sum(abs(a - b) < 1e-12 for a, b in zip(ref, got)))
        total += len(grid)
    return f"{same}/{total}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=Path, default=None, help="JSONL file (default: outside_workload, no gold)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-coverage", type=float, nargs="+", default=[0.5],
                    help="search caps to time, each from its own cache (several: compared with the first)")
    ap.add_argument("--cache", type=Path, default=None, help="verdict cache folder (resumes; default: fresh)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/workload_profile.json")
    args = ap.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="workload-profile-"))
    cache.mkdir(parents=True, exist_ok=True)
    workload = args.workload or label_free_file(cache / "workload.jsonl", args.num_requests, args.seed)
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    rows, demands = [], []
    for cap in args.max_coverage:
        start = time.perf_counter()
        demand = run_workload_demand(pipe, workload, cache / f"cap{cap:g}.workload.json", "fidelity",
                                     args.num_requests, max_coverage=cap)
        wall = time.perf_counter() - start
        demands.append(demand)
        rows.append({"max_coverage": cap, "num_requests": demand.num_requests, "wall_s": wall,
                     "s_per_request": wall / demand.num_requests,
                     "minutes_for_50": BAR_REQUESTS * wall / demand.num_requests / 60, "bar_minutes": BAR_MINUTES,
                     "wall_ratio_to_first": wall / rows[0]["wall_s"] if rows else 1.0,
                     "pass_rates_equal_to_first": agreement(demands[0], demand, min(cap, args.max_coverage[0]))})
    payload = {"workload": demands[0].workload, "gate": demands[0].gate, "rows": rows, "command": command(),
               "commit": commit(), "cpu": cpu(), "threads": torch.get_num_threads()}
    emit(payload, args.json, args.out, lambda: print_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
