"""The held-out protocol: does profiling a user's own workload, without labels, make CacheSmith win
on it, and does CacheSmith hold its ground without that profile?

For each task family (default: `held_out_families.py`'s `archive` and `continue`, which no profile
has seen), `2 N` seeded requests are split into a profiling half and an evaluation half (disjoint
instances). The profiling half, its gold removed, is profiled with `cachesmith profile --workload`'s
code (fidelity gate). The evaluation half is served on two traces (Poisson u0.7, Gamma CV 2 u1.0,
SLO 2x, replay clock, task gate) by three arms:
- `unprofiled`: CacheSmith with the profile's own demand (and its two fixed-signal ablations);
- `profiled`: CacheSmith with the label-free demand of the profiling half;
- `static`: the seven static methods (full prefill, full reuse, four presets at 15%, CacheBlend at 30%).
Both arms share one base SLO and speed factor per family and trace (measured once). Prints a table,
writes `{"rows": [{"family", "trace", "arm", "method", "qsa", "mean_coverage"}], ...}` (default
`docs/bench/held_out_protocol.json`). Every profile verdict and bench run is cached under `--cache`,
so a stopped run resumes.

    python -m benchmarks.held_out_protocol --num-requests 24 --cache /tmp/held-out
    python -m benchmarks.held_out_protocol --families kv describe --cache /tmp/held-out  # outside_workload.py's
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.common.payload import command, commit, cpu, emit, print_table
from benchmarks.held_out_families import DEFAULT_FAMILIES, FAMILIES, OUTSIDE, family_requests

from cachesmith.bench.run import run_bench
from cachesmith.bench.setting import BenchConfig
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.profiler.workload import run_workload_demand
from cachesmith.workloads.corpus import load_corpus

TRACES = {"poisson-u0.7": ("poisson", 1.0, 0.7), "gamma-cv2-u1.0": ("gamma", 2.0, 1.0)}
STATIC = ("full_prefill", "full_reuse", "cacheblend@0.15", "epic@0.15", "prophetkv@0.15", "fusionrag@0.15",
          "cacheblend@0.3")
UNPROFILED = ("cachesmith", "cachesmith:kv_dev", "cachesmith:qci")


def write_halves(folder: Path, family: str, num: int, seed: int) -> tuple[Path, Path]:
    """(profiling half without gold, evaluation half with gold) of `2 num` requests."""
    lines = family_requests(load_corpus(), family, 2 * num, seed)
    profiling, evaluation = folder / f"{family}-profiling.jsonl", folder / f"{family}-evaluation.jsonl"
    profiling.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "gold"}) + "\n"
                                 for x in lines[:num]), encoding="utf-8")
    evaluation.write_text("".join(json.dumps(x) + "\n" for x in lines[num:]), encoding="utf-8")
    return profiling, evaluation


def rows_of(result, family: str, trace: str, arm: str) -> list[dict]:
    return [{"family": family, "trace": trace, "arm": arm, "method": r["method"], "qsa": r["qsa"],
             "mean_coverage": r["recompute_fraction"]} for r in result.rows if r["method"] != "best_static"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=sorted([*FAMILIES, *OUTSIDE]))
    ap.add_argument("--num-requests", type=int, default=24, help="requests per half")
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--trace-seed", type=int, default=1)
    ap.add_argument("--cache", type=Path, required=True, help="folder for verdicts and runs (resumes)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/held_out_protocol.json")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    # memory and disk, as `cachesmith bench`: a bench admits every request first, more chunks than memory holds
    pipe = RagPipeline(store=ChunkStore(StoreConfig(root=args.cache / "kv")))
    rows, profiles, halves = [], {}, {}
    for family in args.families:  # every profile first: the label-free profiles of the profiling halves
        halves[family] = write_halves(args.cache, family, args.num_requests, args.seed)
        start = time.perf_counter()
        demand = run_workload_demand(pipe, halves[family][0], args.cache / f"{family}.workload.json", "fidelity")
        profiles[family] = {"num_requests": demand.num_requests, "wall_s": time.perf_counter() - start,
                            "measured_s": demand.seconds}
    for family in args.families:
        evaluation, demand_path = halves[family][1], args.cache / f"{family}.workload.json"
        for trace, (pattern, cv, utilization) in TRACES.items():
            config = BenchConfig(workload_file=str(evaluation), num_requests=args.num_requests, pattern=pattern,
                                 cv=cv, utilization=utilization, slo_scales=(2.0,),
                                 methods=UNPROFILED + STATIC, gate="task", seed=args.trace_seed)
            base = args.cache / family / trace
            unprofiled = run_bench(pipe, config, base / "unprofiled", is_workload_demand_used=False)
            (base / "profiled").mkdir(parents=True, exist_ok=True)
            shutil.copy(base / "unprofiled" / "base.json", base / "profiled" / "base.json")  # one SLO, one speed
            profiled = run_bench(pipe, replace(config, methods=("cachesmith",)), base / "profiled",
                                 workload_demand=demand_path)
            rows += [{**r, "arm": "static" if r["method"] in STATIC else "unprofiled"}
                     for r in rows_of(unprofiled, family, trace, "")]
            rows += rows_of(profiled, family, trace, "profiled")
    payload = {"rows": rows, "profiles": profiles, "num_requests_per_half": args.num_requests,
               "seed": args.seed, "trace_seed": args.trace_seed, "slo_scale": 2.0,
               "command": command(), "commit": commit(), "cpu": cpu()}
    emit(payload, args.json, args.out, lambda: print_table(rows, ["family", "trace", "arm", "method", "qsa",
                                                                  "mean_coverage"]))


if __name__ == "__main__":
    main()
