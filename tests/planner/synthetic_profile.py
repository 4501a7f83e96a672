"""A hand-built profile shaped like the packaged model's on CPU, for planner tests (no timing)."""
from __future__ import annotations

import numpy as np

from cachesmith.planner.profile import NEVER, DemandCurve, PhaseCost, Profile

COSTS = {  # (intercept, per row, per pair, per aux row, per request)
    "full": PhaseCost(0.0, 8e-5, 2e-8, 0.0, 2e-4),
    "qci_probe": PhaseCost(0.0, 9e-5, 4e-7, 0.0, 3e-4),
    "query_only": PhaseCost(8e-4, 1e-7, 3e-6),
    "score_patch": PhaseCost(0.0, 8e-5, 1e-8, 4e-5, 2e-4),
    "patch": PhaseCost(3e-3, 6e-5, 3e-8, 0.0, 4e-4),
    "select": PhaseCost(5e-3, 2e-6, 0.0, 0.0, 1e-3),  # ranking, row loads, Patch row plans
}
OVERHEAD = PhaseCost(0.02, 8e-6, 0.0, 0.0, 3e-3)  # per batch, token, -, -, request


def demand_curve(signal: str, depth: int, median: float, num: int = 200, never: float = 0.1) -> DemandCurve:
    """Log-normal-ish demands around `median`, a `never` fraction that no coverage fixes."""
    rng = np.random.default_rng(depth * 7 + len(signal))
    values = np.clip(np.round(median * rng.lognormal(0, 0.8, num) / 0.05) * 0.05, 0, 1)
    values[: int(never * num)] = NEVER
    return DemandCurve(signal, depth, tuple(float(v) for v in values))


def make_profile(num_layers: int = 30, kv_bytes: int = 1536, gbps: float = 5.0) -> Profile:
    # deeper ranking lowers the coverage requests need (paper Fig. 2b)
    demand = tuple(demand_curve(s, d, m) for s, base in (("kv_dev", 0.35), ("qci", 0.25))
                   for d, m in ((2, base), (6, base * 0.6), (15, base * 0.4)))
    return Profile("fp-test", "synthetic", "float32", "cpu", num_layers, kv_bytes, dict(COSTS),
                   OVERHEAD, {"memory": gbps}, demand, 0.6)
