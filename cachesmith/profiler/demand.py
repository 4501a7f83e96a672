"""Demand profiling (paper §5.1, Fig. 2/7): for each profiling request, the minimum sufficient
coverage (5% grid, binary search) per signal at the anchor rank depths (5%, 20%, 50% of the layers,
p = 1, so w = depth - 1), at rank depth 1 for KV deviation (CacheBlend's (1, 0): the planner's
cheapest ranking) and for the fixed-split families (qci_last and fused, (1, L - 1)) at rank depth L, plus its
layer-0 QCI entropy; and the entropy threshold that best routes requests to the signal that needs
less coverage.

In: a `RagPipeline` and workload instances (default: the served mix, MIX; or a user's workload file)
and a gate: `task` (the task's metric against the gold) or `fidelity` (the answer's canonical form
equals full prefill's: no gold needed, so any served workload can be profiled). Out: `DemandCurve`s
(over all instances and, where they hold several tasks, per task) and theta. The gate reads the
whole answer, as serving's does.
Long and offline: every evaluated (request, signal, depth, coverage) is appended to a JSONL cache,
so a stopped run resumes, and a progress bar counts requests. The searches of one request run in
lockstep, so each round's plans share their rankings and their decoding (`Verdicts`).
"""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import NEVER, DemandCurve
from cachesmith.profiler.verdicts import Verdicts
from cachesmith.recompute import FIXED_FAMILIES, RecomputeConfig, preset
from cachesmith.workloads.gates import make_gate
from cachesmith.workloads.instance import WorkloadInstance

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
    gate: str = "task"

    def __post_init__(self) -> None:
        self._gate = make_gate(self.gate)
        self.verdicts = Verdicts(self.pipe, Path(self.cache_path), self.max_new_tokens)

    def passed(self, inst: WorkloadInstance, record: dict) -> bool:
        """The gate's verdict on one measured record (fidelity: against full prefill's answer)."""
        if not self._gate.needs_reference:
            return bool(record["passed"])
        full = preset("full_prefill", 1.0, self.pipe.model.num_layers)
        reference = self.measure(inst, [(full, "full_prefill")])[0]["text"]  # cached after its first run
        return self._gate.passes(inst, record["text"], reference)

    def measure(self, inst: WorkloadInstance, trials: list[tuple[RecomputeConfig, str]]) -> list[dict]:
        """Each trial's record `{"passed", "entropy", ...}`, measured together (`Verdicts`)."""
        return self.verdicts.measure(inst, trials)

    def evaluate(self, inst: WorkloadInstance, plan: RecomputeConfig, tag: str) -> dict:
        return self.measure(inst, [(plan, tag)])[0]

    def flips(self, inst: WorkloadInstance, keys: list[tuple[str, int]], high: bool) -> dict[tuple[str, int], tuple[bool, float]]:
        """Per (signal, rank depth): the verdict at 0% (`low`) and the coverage where full prefill's
        verdict `high` takes over (1.0 when low == high), one flip assumed. The keys' binary
        searches run in lockstep: each round measures one step of every unfinished search together.
        Rank depth 1 is CacheBlend's family (kv_dev, 1, 0); every other depth is (S, depth - 1, 1)."""
        searches = {k: flip_search(high) for k in keys}
        pending = {k: next(g) for k, g in searches.items()}
        found = {}
        while pending:
            trials = [(plan_at(s, d, step), f"{s}/{d}/{step}") for (s, d), step in pending.items()]
            verdicts = [self.passed(inst, r) for r in self.measure(inst, trials)]
            nxt = {}
            for (key, _), passed in zip(pending.items(), verdicts):
                try:
                    nxt[key] = searches[key].send(passed)
                except StopIteration as done:
                    found[key] = done.value
            pending = nxt
        return found

    def pass_intervals(self, inst: WorkloadInstance, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[float, float]]:
        """[from, until) per (signal, rank depth) where the request passes on the 5% grid:
        (minimum sufficient coverage, NEVER) when full prefill passes, (0, the first failing
        coverage) when only the low side does, (NEVER, NEVER) when neither."""
        full = preset("full_prefill", 1.0, self.pipe.model.num_layers)
        high = self.passed(inst, self.evaluate(inst, full, "full_prefill"))
        return {k: flip_interval(low, high, at) for k, (low, at) in self.flips(inst, keys, high).items()}

    def entropy(self, inst: WorkloadInstance) -> float:
        return float(self.evaluate(inst, plan_at("kv_dev", 2, 0), "kv_dev/2/0")["entropy"])

    def run(self, instances: list[WorkloadInstance], signals=SIGNALS, show_progress: bool = True):
        depths = anchor_depths(self.pipe.model.num_layers)
        keys = [(s, d) for s in signals for d in depths]
        if "kv_dev" in signals:  # the planner's rank depth 1: CacheBlend's (1, 0), bursts' workhorse
            keys.insert(0, ("kv_dev", 1))
        keys += [(s, self.pipe.model.num_layers) for s in FIXED_FAMILIES]  # fixed-split families: rank depth L
        demands, until = {k: [] for k in keys}, {k: [] for k in keys}
        entropies = []
        for inst in tqdm(instances, desc="profile demand", unit="req", disable=not show_progress):
            for k, (low, high) in self.pass_intervals(inst, keys).items():
                demands[k].append(low)
                until[k].append(high)
            entropies.append(self.entropy(inst))
        curves = task_curves(demands, [inst.task for inst in instances], until)
        mid = depths[len(depths) // 2]
        theta = fit_threshold(entropies, demands.get(("kv_dev", mid), []), demands.get(("qci", mid), []))
        return curves, theta, entropies


def plan_at(signal: str, depth: int, step: int) -> RecomputeConfig:
    """The plan of rank depth `depth` at grid step `step`: (kv_dev, 1, 0) at depth 1 (CacheBlend's
    family), a fixed-split family's own plan for qci_last and fused (`recompute.FIXED_FAMILIES`,
    depth = L), (S, depth - 1, 1) otherwise."""
    if signal in FIXED_FAMILIES:
        return FIXED_FAMILIES[signal](step / GRID_STEPS, depth)
    warmup, probe = (1, 0) if depth == 1 else (depth - 1, 1)
    return RecomputeConfig(signal, warmup, probe, step / GRID_STEPS)


def flip_search(high: bool) -> Generator[int, bool, tuple[bool, float]]:
    """Yields the grid steps to measure and takes their verdicts: step 0 first (the low side), then
    a binary search for the first step with full prefill's verdict `high` (one flip assumed; step
    GRID_STEPS is full prefill itself). Returns (low, coverage where `high` begins)."""
    low = yield 0
    if low == high:
        return low, 1.0
    lo, hi = 0, GRID_STEPS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if (yield mid) == high else (mid, hi)
    return low, hi / GRID_STEPS


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
