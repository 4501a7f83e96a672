"""SLO-aware scheduler decision time on random queues (paper §5.2: "a few milliseconds").

Queues of 1-64 requests (contexts 256-4096 tokens, SLOs 1-4x a 2 s base, arrivals spread over the
last few seconds, a burst every fifth queue), decided with the packaged model's profile (or
--profile). Reports per queue-depth group the p50/p99 decision time, candidates evaluated and how
often the 256 cap was reached. `--json` prints {"rows": [...], "decision_ms_p99"}.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common.payload import emit, print_table

from cachesmith.planner import Planner, Profile
from cachesmith.calibration.packaged import PACKAGED_DIR
from cachesmith.scheduler import QueuedRequest, SchedulerConfig, SloAwareScheduler

GROUPS = ((1, 4), (5, 16), (17, 32), (33, 64))


def random_queue(rng: np.random.Generator, depth: int, is_burst: bool) -> list[QueuedRequest]:
    now = 10.0
    arrivals = np.full(depth, now - 0.1) if is_burst else now - rng.uniform(0, 6, depth)
    return [QueuedRequest(i, float(a), float(2.0 * rng.uniform(1, 4)), int(rng.integers(256, 4097)),
                          int(rng.integers(16, 64)), 24) for i, a in enumerate(arrivals)]


def measure(scheduler: SloAwareScheduler, num_queues: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_queues):
        lo, hi = GROUPS[i % len(GROUPS)]
        depth = int(rng.integers(lo, hi + 1))
        d = scheduler.next_batch(random_queue(rng, depth, i % 5 == 0), 10.0)
        samples.append((lo, hi, 1e3 * d.decision_s, d.num_candidates))
    rows = []
    for lo, hi in GROUPS:
        ms = np.array([s[2] for s in samples if s[0] == lo])
        cands = np.array([s[3] for s in samples if s[0] == lo])
        rows.append({"queue_depth": f"{lo}-{hi}", "num_queues": len(ms), "decision_ms_p50": float(np.percentile(ms, 50)),
                     "decision_ms_p99": float(np.percentile(ms, 99)), "candidates_mean": float(cands.mean()),
                     "cap_reached": float((cands >= scheduler.config.max_candidates).mean())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", type=Path, default=PACKAGED_DIR / "smollm2-135m-float32-cpu.json")
    ap.add_argument("--num-queues", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="results/scheduler.json")
    args = ap.parse_args()
    scheduler = SloAwareScheduler(Planner(Profile.load(args.profile)), SchedulerConfig(max_batch_size=16))
    measure(scheduler, 20, seed=1)  # warm-up (imports, numpy first calls)
    rows = measure(scheduler, args.num_queues)
    payload = {"rows": rows, "decision_ms_p99": max(r["decision_ms_p99"] for r in rows)}
    emit(payload, args.json, args.out, lambda: print_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
