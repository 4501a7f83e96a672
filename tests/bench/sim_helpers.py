"""A hand-built outcome table over the synthetic profile's layer count (no model)."""
from __future__ import annotations

from cachesmith.recompute import preset
from cachesmith.bench.outcomes import Flip, Outcome, OutcomeTable, fixed_plans

NUM_LAYERS = 30


def outcome(seed: int, task: str = "pr", context: int = 800, full: bool = True, reuse: bool = False,
            at: float = 0.3, entropy: float = 0.5) -> Outcome:
    """Passes under full prefill (`full`), under full reuse (`reuse`), and under every planner plan
    from coverage `at` (anchor depth 2; deeper anchors need 0.1 less)."""
    plans = {p.label(): reuse for p in fixed_plans(NUM_LAYERS)}
    plans[preset("full_prefill", 1.0, NUM_LAYERS).label()] = full
    plans[preset("cacheblend", 0.3, NUM_LAYERS).label()] = full
    flips = {f"{s}/{d}": Flip(reuse, full, max(0.0, at - 0.1 * i) if reuse != full else 1.0)
             for s in ("kv_dev", "qci") for i, d in enumerate((2, 6, 15))}
    return Outcome(f"d{seed}", task, seed, 10, context, 30, 4, entropy, plans, flips)


def table(num: int = 24) -> OutcomeTable:
    tasks = ("pr", "msq", "vt", "mv")
    return OutcomeTable("synthetic", NUM_LAYERS, 8192,
                        [outcome(i, tasks[i % 4], 400 + 150 * (i % 7), full=i % 5 != 0, reuse=i % 3 == 0,
                                 at=0.05 * (i % 8), entropy=0.3 + 0.05 * (i % 9)) for i in range(num)])
