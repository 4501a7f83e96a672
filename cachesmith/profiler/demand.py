"""Demand profiling (paper §5.1, Fig. 2/7): for each profiling request, the minimum sufficient
coverage (5% grid, binary search) per signal at the anchor rank depths (5%, 20%, 50% of the layers,
p = 1, so w = depth - 1) and at rank depth 1 for KV deviation (CacheBlend's (1, 0): the planner's
cheapest ranking), plus its layer-0 QCI entropy; and the entropy threshold that best routes
requests to the signal that needs less coverage.

In: a `RagPipeline` and workload instances (default: the served mix, MIX). Out: `DemandCurve`s (over
all instances and, where they hold several tasks, per task) and theta. The gate reads the whole
answer, as serving's does.
Long and offline: every evaluated (request, signal, depth, coverage) is appended to a JSONL cache,
so a stopped run resumes, and a progress bar counts requests.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cachesmith.jsonl import load_keyed
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import NEVER, DemandCurve
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.workloads.card import instance_digest, answer_instance
from cachesmith.workloads.instance import WorkloadInstance
from cachesmith.workloads.scoring import score

ANCHOR_FRACTIONS = (0.05, 0.20, 0.50)
GRID_STEPS = 20  # 5% steps
SIGNALS = ("kv_dev", "qci")


def anchor_depths(num_layers: int, fractions=ANCHOR_FRACTIONS) -> list[int]:
    return sorted({max(2, round(f * num_layers)) for f in fractions})


@dataclass
class DemandProfiler:
    pipe: RagPipeline
    cache_path: Path
    max_new_tokens: int = 1 << 30  # the instance's own answer length: the gate reads all of it

    def __post_init__(self) -> None:
        self.cache = load_keyed(self.cache_path)
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)

    def evaluate(self, inst: WorkloadInstance, plan: RecomputeConfig, tag: str) -> dict:
        key = f"{instance_digest(inst)}/{tag}"
        if key not in self.cache:
            short = WorkloadInstance(**{**inst.__dict__, "max_new_tokens": min(inst.max_new_tokens,
                                                                                 self.max_new_tokens)})
            ans = answer_instance(self.pipe, short, plan)
            rec = {"key": key, "passed": score(inst, ans.text).passed, "entropy": ans.qci_entropy}
            with self.cache_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            self.cache[key] = rec
        return self.cache[key]

    def pass_interval(self, inst: WorkloadInstance, signal: str, depth: int) -> tuple[float, float]:
        """[from, until) on the grid where the request passes, one flip assumed between 0% and
        full prefill: (minimum sufficient coverage, NEVER) when full prefill passes, (0, the first
        failing coverage) when only the low side does, (NEVER, NEVER) when neither. Rank depth 1 is
        CacheBlend's family (kv_dev, 1, 0); every other depth is (S, depth - 1, 1)."""
        L = self.pipe.model.num_layers
        high = self.evaluate(inst, preset("full_prefill", 1.0, L), "full_prefill")["passed"]
        warmup, probe = (1, 0) if depth == 1 else (depth - 1, 1)

        def passes(step: int) -> bool:
            plan = RecomputeConfig(signal, warmup, probe, step / GRID_STEPS)
            return self.evaluate(inst, plan, f"{signal}/{depth}/{step}")["passed"]

        low = passes(0)
        return flip_interval(low, high, 1.0 if low == high else flip_step(passes, high) / GRID_STEPS)

    def entropy(self, inst: WorkloadInstance) -> float:
        plan = RecomputeConfig("kv_dev", 1, 1, 0.0)
        return float(self.evaluate(inst, plan, "kv_dev/2/0")["entropy"])

    def run(self, instances: list[WorkloadInstance], signals=SIGNALS, show_progress: bool = True):
        depths = anchor_depths(self.pipe.model.num_layers)
        keys = [(s, d) for s in signals for d in depths]
        if "kv_dev" in signals:  # the planner's rank depth 1: CacheBlend's (1, 0), bursts' workhorse
            keys.insert(0, ("kv_dev", 1))
        demands, until = {k: [] for k in keys}, {k: [] for k in keys}
        entropies = []
        for inst in tqdm(instances, desc="profile demand", unit="req", disable=not show_progress):
            for s, d in keys:
                low, high = self.pass_interval(inst, s, d)
                demands[(s, d)].append(low)
                until[(s, d)].append(high)
            entropies.append(self.entropy(inst))
        curves = task_curves(demands, [inst.task for inst in instances], until)
        mid = depths[len(depths) // 2]
        theta = fit_threshold(entropies, demands.get(("kv_dev", mid), []), demands.get(("qci", mid), []))
        return curves, theta, entropies


def flip_step(passes: Callable[[int], bool], high: bool) -> int:
    """The first grid step with full prefill's verdict `high`, by binary search, given that step 0
    has the other one (one flip assumed; step GRID_STEPS is full prefill itself)."""
    lo, hi = 0, GRID_STEPS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) == high else (mid, hi)
    return hi


def flip_interval(low: bool, high: bool, at: float) -> tuple[float, float]:
    """[from, until) where a request passes, given its verdict at 0% (`low`), at full prefill
    (`high`) and the coverage `at` where one turns into the other."""
    if high:
        return (0.0 if low else at), NEVER
    return (0.0, at) if low else (NEVER, NEVER)


def task_curves(demands: dict[tuple[str, int], list[float | None]], tasks: list[str],
                until: dict[tuple[str, int], list[float | None]] | None = None) -> tuple[DemandCurve, ...]:
    """Curves over every request (the served mix's) and, where the requests hold several tasks,
    each task's own, for requests that name it. `demands[(signal, depth)][i]` is request i's
    minimum sufficient coverage (None: not measured, left out), `until[(signal, depth)][i]` where
    it fails again (NEVER: it does not; no `until`: none does); `tasks[i]` its task."""
    groups = [None] + (sorted(set(tasks)) if len(set(tasks)) > 1 else [])
    curves = []
    for task in groups:
        for key, values in demands.items():
            ends = (until or {}).get(key) or [NEVER] * len(values)
            kept = [(v, e) for v, e, t in zip(values, ends, tasks) if v is not None and task in (None, t)]
            if kept:
                ends_kept = tuple(e for _, e in kept)
                curves.append(DemandCurve(key[0], key[1], tuple(v for v, _ in kept), task,
                                          None if all(math.isinf(e) for e in ends_kept) else ends_kept))
    return tuple(curves)


def fit_threshold(entropies: list[float], kv_dev: list[float], qci: list[float], default: float = 0.5) -> float:
    """theta maximizing how often "kv_dev if H > theta else qci" picks the signal needing less
    coverage (ties and requests that never pass say nothing)."""
    labelled = [(h, a < b) for h, a, b in zip(entropies, kv_dev, qci)
                if a != b and not (math.isinf(a) and math.isinf(b))]
    if not labelled:
        return default
    cuts = sorted({h for h, _ in labelled})
    candidates = [cuts[0] - 1e-6] + [(a + b) / 2 for a, b in zip(cuts, cuts[1:])] + [cuts[-1] + 1e-6]

    def correct(theta: float) -> int:
        return sum((h > theta) == prefers_kv for h, prefers_kv in labelled)

    return float(max(candidates, key=lambda t: (correct(t), -abs(t - default))))
