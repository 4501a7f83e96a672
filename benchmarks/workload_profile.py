"""How long `cachesmith profile --workload` takes: the label-free (fidelity gate) demand profile of a
workload file the profile has never seen, on the packaged model.

Default workload: `outside_workload.py`'s two tasks (a lookup among look-alikes, a short
description), with the gold removed, since the point is an operator's file without labels. Prints
the wall time, the time per request and the time 50 requests would take at that rate (the bar:
15 minutes on 2 cores), for each flip search (`profiler.demand.SEARCHES`: bisection from 50%, and
galloping up from 5%, which the workload profile uses) in the same run, and writes the JSON
(default `docs/bench/workload_profile.json`). Verdicts are cached under `--cache` (default: a fresh folder), so a stopped run resumes.

    python benchmarks/workload_profile.py --num-requests 8
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit, print_table  # noqa: E402
from outside_workload import outside_requests  # noqa: E402

from cachesmith.kvstore import ChunkStore, StoreConfig  # noqa: E402
from cachesmith.pipeline import RagPipeline  # noqa: E402
from cachesmith.profiler.workload import run_workload_demand  # noqa: E402
from cachesmith.workloads.corpus import load_corpus  # noqa: E402

BAR_REQUESTS, BAR_MINUTES = 50, 15.0


def label_free_file(path: Path, num_requests: int, seed: int) -> Path:
    """`outside_workload.py`'s requests without their gold answers."""
    lines = outside_requests(load_corpus(), num_requests, seed)
    path.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "gold"}) + "\n" for line in lines))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=Path, default=None, help="JSONL file (default: outside_workload, no gold)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--search", nargs="+", default=["bisect", "gallop"], choices=["bisect", "gallop"],
                    help="flip searches to time, each on the same requests (default: both)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache", type=Path, default=None, help="verdict cache folder (resumes; default: fresh)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/workload_profile.json")
    args = ap.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="workload-profile-"))
    cache.mkdir(parents=True, exist_ok=True)
    workload = args.workload or label_free_file(cache / "workload.jsonl", args.num_requests, args.seed)
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    rows, curves = [], {}
    for search in args.search:  # each with its own verdict cache: no search reads another's answers
        start = time.perf_counter()
        demand = run_workload_demand(pipe, workload, cache / f"{search}.workload.json", "fidelity",
                                     args.num_requests, search=search)
        wall = time.perf_counter() - start
        curves[search] = {(c.signal, c.rank_depth, c.task): c.demands for c in demand.demand}
        rows.append({"search": search, "num_requests": demand.num_requests, "wall_s": wall,
                     "s_per_request": wall / demand.num_requests,
                     "minutes_for_50": BAR_REQUESTS * wall / demand.num_requests / 60, "bar_minutes": BAR_MINUTES})
    first = curves[args.search[0]]
    for row in rows:  # one flip assumed by both searches: where a request flips twice they may differ
        mine = curves[row["search"]]
        pairs = [(a, b) for k in first for a, b in zip(first[k], mine.get(k, ()))]
        row["demands_equal_to_first"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        row["wall_ratio_to_first"] = row["wall_s"] / rows[0]["wall_s"]
    payload = {"workload": demand.workload, "gate": demand.gate, "rows": rows, "command": " ".join(sys.argv),
               "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    emit(payload, args.json, args.out, lambda: print_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
