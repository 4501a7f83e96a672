"""Demand profiling (paper §5.1, Fig. 2/7): for each profiling request, the minimum sufficient
coverage (5% grid, binary search) per signal at the anchor rank depths (5%, 20%, 50% of the layers,
p = 1, so w = depth - 1), at rank depth 1 for KV deviation (CacheBlend's (1, 0): the planner's
cheapest ranking) and for the fixed-split families (qci_last and fused, (1, L - 1)) at rank depth L, plus its
layer-0 QCI entropy; and the entropy threshold that best routes requests to the signal that needs
less coverage.

In: a `RagPipeline` and `Subject`s, requests as plain data (`profiler` builds them from the served
mix, MIX, or a user's workload file; shadow work from served requests) and a gate: `task` (the
task's metric against the gold) or `fidelity` (the answer's canonical form equals full prefill's:
no gold needed, so any served workload can be profiled). Out: `DemandCurve`s
(over all instances and, where they hold several tasks, per task) and theta. The gate reads the
whole answer, as serving's does.
Long: offline, every evaluated (request, signal, depth, coverage) is appended to a JSONL cache,
so a stopped run resumes, and a progress bar counts requests. The searches of one request run in
lockstep, so each round's plans share their rankings and their decoding (`Verdicts`).
"""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cachesmith.errors import InputError
from cachesmith.gates import make_gate
from cachesmith.calibration.subjects import Subject
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import NEVER, DemandCurve
from cachesmith.calibration.verdicts import Verdicts
from cachesmith.recompute import FIXED_FAMILIES, RecomputeConfig, preset

ANCHOR_FRACTIONS = (0.05, 0.20, 0.50)
GRID_STEPS = 20  # 5% steps
SIGNALS = ("kv_dev", "qci")


def anchor_depths(num_layers: int, fractions=ANCHOR_FRACTIONS) -> list[int]:
    return sorted({max(2, round(f * num_layers)) for f in fractions})


@dataclass
class DemandProfiler:
    pipe: RagPipeline
    cache_path: Path | None  # None: verdicts in memory only
    max_new_tokens: int = 1 << 30  # the instance's own answer length: the gate reads all of it
    gate: str = "task"
    # flips above this coverage are recorded at full prefill's (1.0) rather than searched for
    # (`flip_search`); 1.0 searches the whole grid
    max_coverage: float = 1.0
    # requests searched in lockstep: their rounds share each decoding step (memory: each holds
    # its forks' KV caches)
    num_parallel: int = 6

    def __post_init__(self) -> None:
        if self.num_parallel < 1:
            raise InputError(f"num_parallel={self.num_parallel} must be >= 1")
        if not 0 < self.max_coverage <= 1 or abs(self.max_coverage * GRID_STEPS - round(self.max_coverage * GRID_STEPS)) > 1e-9:
            raise InputError(f"max_coverage={self.max_coverage} must be a step of the 5% grid in (0, 1]")
        self._gate = make_gate(self.gate)
        self.verdicts = Verdicts(self.pipe, self.cache_path, self.max_new_tokens, max_held=self.num_parallel + 1)

    def passed(self, inst: Subject, record: dict) -> bool:
        """The gate's verdict on one measured record (fidelity: against full prefill's answer)."""
        if not self._gate.needs_reference:
            return bool(record["passed"])
        full = preset("full_prefill", 1.0, self.pipe.model.num_layers)
        reference = self.measure(inst, [(full, "full_prefill")])[0]["text"]  # cached after its first run
        return self._gate.passes(inst.expected, record["text"], reference)

    def measure(self, inst: Subject, trials: list[tuple[RecomputeConfig, str]]) -> list[dict]:
        """Each trial's record `{"passed", "entropy", ...}`, measured together (`Verdicts`)."""
        return self.measure_many([(inst, trials)])[0]

    def measure_many(self, batch: list[tuple[Subject, list[tuple[RecomputeConfig, str]]]]) -> list[list[dict]]:
        """`measure` for several instances together: their answers share each decoding step."""
        return self.verdicts.measure_many(batch)

    def evaluate(self, inst: Subject, plan: RecomputeConfig, tag: str) -> dict:
        return self.measure(inst, [(plan, tag)])[0]

    def flips(self, inst: Subject, keys: list[tuple[str, int]], high: bool) -> dict[tuple[str, int], tuple[bool, float]]:
        """Per (signal, rank depth): the verdict at 0% (`low`) and the coverage where full prefill's
        verdict `high` takes over (1.0 when low == high), one flip assumed (`flip_search`)."""
        return self.flips_many([inst], keys, [high])[0]

    def flips_many(self, insts: list[Subject], keys: list[tuple[str, int]],
                   highs: list[bool]) -> list[dict[tuple[str, int], tuple[bool, float]]]:
        """`flips` of several instances in lockstep: each round measures one step of every
        unfinished search of every instance together (`measure_many`)."""
        rounds = self.search_rounds(insts, keys, highs)
        while True:
            try:
                next(rounds)
            except StopIteration as done:
                return done.value

    def search_rounds(self, insts: list[Subject], keys: list[tuple[str, int]], highs: list[bool]
                      ) -> Generator[None, None, list[dict[tuple[str, int], tuple[bool, float]]]]:
        """`flips_many` one round at a time: yields after each round's measurement (so idle-time
        work can stop between rounds) and returns the flips.
        Rank depth 1 is CacheBlend's family (kv_dev, 1, 0); every other depth is (S, depth - 1, 1)."""
        max_step = round(self.max_coverage * GRID_STEPS)
        searches = {(i, k): flip_search(high, max_step) for i, high in enumerate(highs) for k in keys}
        pending = {ik: next(g) for ik, g in searches.items()}
        found: list[dict] = [{} for _ in insts]
        while pending:
            rounds = [[(ik, plan_at(*ik[1], step), f"{ik[1][0]}/{ik[1][1]}/{step}")
                       for ik, step in pending.items() if ik[0] == i] for i in range(len(insts))]
            kept = [(insts[i], r) for i, r in enumerate(rounds) if r]
            records = self.measure_many([(inst, [(plan, tag) for _, plan, tag in r]) for inst, r in kept])
            nxt = {}
            for (inst, r), recs in zip(kept, records):
                for (ik, _, _), rec in zip(r, recs):
                    try:
                        nxt[ik] = searches[ik].send(self.passed(inst, rec))
                    except StopIteration as done:
                        found[ik[0]][ik[1]] = done.value
            pending = nxt
            yield
        return found

    def sample_rounds(self, inst: Subject, keys: list[tuple[str, int]]
                      ) -> Generator[None, None, dict[tuple[str, int], tuple[float, float]]]:
        """`pass_intervals` of one instance one measurement at a time (full prefill, then each
        round): the unit of idle-time (shadow) work."""
        full = preset("full_prefill", 1.0, self.pipe.model.num_layers)
        high = self.passed(inst, self.measure(inst, [(full, "full_prefill")])[0])
        yield
        found = yield from self.search_rounds([inst], keys, [high])
        if self.cache_path is None:  # memory only: nothing of it is read again
            self.verdicts.forget(inst)
        return {k: flip_interval(low, high, at) for k, (low, at) in found[0].items()}

    def keys(self, signals=SIGNALS, fixed_families: tuple[str, ...] = tuple(FIXED_FAMILIES)) -> list[tuple[str, int]]:
        """The (signal, rank depth) searches of a profile: the anchor depths of `signals`, kv_dev's
        rank depth 1 (CacheBlend's (1, 0)), and the fixed-split families at rank depth L."""
        depths = anchor_depths(self.pipe.model.num_layers)
        keys = [(s, d) for s in signals for d in depths]
        if "kv_dev" in signals:  # the planner's rank depth 1: CacheBlend's (1, 0), bursts' workhorse
            keys.insert(0, ("kv_dev", 1))
        return keys + [(s, self.pipe.model.num_layers) for s in fixed_families]

    def pass_intervals(self, inst: Subject, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[float, float]]:
        """[from, until) per (signal, rank depth) where the request passes on the 5% grid:
        (minimum sufficient coverage, NEVER) when full prefill passes, (0, the first failing
        coverage) when only the low side does, (NEVER, NEVER) when neither."""
        return self.pass_intervals_many([inst], keys)[0]

    def pass_intervals_many(self, insts: list[Subject],
                            keys: list[tuple[str, int]]) -> list[dict[tuple[str, int], tuple[float, float]]]:
        full = preset("full_prefill", 1.0, self.pipe.model.num_layers)
        # full prefill with every search's first step (0%, whatever full prefill's verdict): one
        # walk per request computes full prefill and the WarmUp layers of every fork
        firsts = [(full, "full_prefill")] + [(plan_at(*k, 0), f"{k[0]}/{k[1]}/0") for k in keys]
        fulls = self.measure_many([(inst, firsts) for inst in insts])
        highs = [self.passed(inst, recs[0]) for inst, recs in zip(insts, fulls)]
        return [{k: flip_interval(low, high, at) for k, (low, at) in found.items()}
                for high, found in zip(highs, self.flips_many(insts, keys, highs))]

    def entropy(self, inst: Subject) -> float:
        return float(self.evaluate(inst, plan_at("kv_dev", 2, 0), "kv_dev/2/0")["entropy"])

    def run(self, instances: list[Subject], signals=SIGNALS, show_progress: bool = True,
            fixed_families: tuple[str, ...] = tuple(FIXED_FAMILIES)):
        keys = self.keys(signals, fixed_families)
        demands, until = {k: [] for k in keys}, {k: [] for k in keys}
        entropies = []
        with tqdm(total=len(instances), desc="profile demand", unit="req", disable=not show_progress) as bar:
            for start in range(0, len(instances), self.num_parallel):
                group = instances[start:start + self.num_parallel]
                for inst, intervals in zip(group, self.pass_intervals_many(group, keys)):
                    for k, (low, high) in intervals.items():
                        demands[k].append(low)
                        until[k].append(high)
                    entropies.append(self.entropy(inst))
                bar.update(len(group))
        curves = task_curves(demands, [inst.task for inst in instances], until)
        depths = anchor_depths(self.pipe.model.num_layers)
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


def flip_search(high: bool, max_step: int = GRID_STEPS) -> Generator[int, bool, tuple[bool, float]]:
    """Yields the grid steps to measure and takes their verdicts: step 0 first (the low side), then
    a binary search for the first step with full prefill's verdict `high` (one flip assumed; step
    GRID_STEPS is full prefill itself). Returns (low, coverage where `high` begins).
    Below GRID_STEPS, `max_step` censors the search: a request still on the low side there is
    recorded as flipping at full prefill. The planner sizes plans by demand only up to its
    saturation coverage (`PlannerConfig.r_max`); above it, it takes the most coverage the budget
    fits whatever the curves say. A flip up there costs the search its heaviest trials, about 3 of
    its 5 steps, and is not worth them."""
    low = yield 0
    if low == high:
        return low, 1.0
    lo, hi = 0, GRID_STEPS
    if max_step < GRID_STEPS:
        if (yield max_step) != high:
            return low, 1.0
        hi = max_step
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
