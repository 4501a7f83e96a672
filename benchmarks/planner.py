"""Planner decision time, cost-model error and the demand table (paper Fig. 2 style).

Reads the profile written by `cachesmith profile` (default path for the packaged model, float32,
CPU); when that is missing or unusable, the packaged profile (as shipped: decision time does not
depend on this machine's speed, but the cost-model error is then the packaging machine's), and says so.
decision: --num-batches random batches of 1-16 requests (contexts 256-4096 tokens, QCI entropies
spread around the threshold), budgets drawn inside each batch's band, plus a few outside it;
p50/p99 of `Planner.plan` wall time. cost_model_rel_err: the profile's held-out TTFT error (mean;
max reported too). demand: median and p90 minimum sufficient coverage per signal and rank depth.
`--json` prints {"decision_ms_p50", "decision_ms_p99", "cost_model_rel_err", "demand": [...]}.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common.payload import emit, print_table
from benchmarks.common.profile import load_profile

from cachesmith.planner import Planner, PlanRequest, Profile
from cachesmith.planner.demand import DemandModel


def decision_times(planner: Planner, num_batches: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    theta = planner.theta
    times = []
    for i in range(num_batches):
        n = int(rng.integers(1, 17))
        reqs = [PlanRequest(int(rng.integers(256, 4097)), int(rng.integers(16, 64)), 24,
                            float(np.clip(theta + rng.normal(0, 0.1), 0, 1))) for _ in range(n)]
        signal = planner.choose_signal(reqs)
        floor, saturation = planner.band(planner.shape(reqs), signal)
        budget = rng.uniform(floor, saturation) if i % 10 else rng.uniform(0.5 * floor, 1.5 * saturation)
        times.append(planner.plan(reqs, float(budget)).decision_s)
    return times


def demand_rows(profile: Profile) -> list[dict]:
    model = DemandModel(profile.demand)
    rows = []
    for curve in sorted(profile.demand, key=lambda c: (c.signal, c.rank_depth)):
        demands = np.asarray(curve.demands)
        never = np.isinf(demands).mean()
        passable = np.sort(demands[~np.isinf(demands)])
        rows.append({"signal": curve.signal, "rank_depth": curve.rank_depth,
                     "median_coverage": model.quantile(curve.signal, curve.rank_depth, 0.5),
                     "p90_coverage": model.quantile(curve.signal, curve.rank_depth, 0.9),
                     # among the requests full prefill gets right (the rest never pass)
                     "passable_median": float(np.quantile(passable, 0.5, method="higher")) if passable.size else None,
                     "passable_p90": float(np.quantile(passable, 0.9, method="higher")) if passable.size else None,
                     "never_fraction": round(float(never), 3), "num_requests": len(curve.demands)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", type=Path, default=None,
                    help="default: the measured profile of the packaged model, else the packaged one")
    ap.add_argument("--num-batches", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="results/planner.json")
    args = ap.parse_args()
    profile, source = load_profile(args.profile)
    planner = Planner(profile)
    planner.plan([PlanRequest(1024, 32, 24, 0.5)], 1.0)  # warm caches
    ms = np.array(decision_times(planner, args.num_batches)) * 1e3
    payload = {"decision_ms_p50": float(np.percentile(ms, 50)), "decision_ms_p99": float(np.percentile(ms, 99)),
               "cost_model_rel_err": profile.fit_error.get("ttft_rel_err_mean"),
               "cost_model_rel_err_max": profile.fit_error.get("ttft_rel_err_max"),
               "entropy_threshold": profile.entropy_threshold, "tier_gbps": profile.tier_gbps,
               "profile_source": source, "demand": demand_rows(profile)}

    def table() -> None:
        print(f"planner decision over {args.num_batches} batches of 1-16 requests: "
              f"p50 {payload['decision_ms_p50']:.2f} ms, p99 {payload['decision_ms_p99']:.2f} ms")
        print(f"cost model TTFT error on held-out shapes ({source} profile): mean {payload['cost_model_rel_err']:.1%}, "
              f"max {payload['cost_model_rel_err_max']:.1%}")
        print_table(payload["demand"], ["signal", "rank_depth", "median_coverage", "p90_coverage",
                                        "passable_median", "passable_p90", "never_fraction", "num_requests"])
    emit(payload, args.json, args.out, table)


if __name__ == "__main__":
    main()
