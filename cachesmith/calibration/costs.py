"""Compute cost profiling through the serving path: stage stored chunk KV with the transfer engine
and run the batch, exactly as `BatchExecutor._timed_run` does (staging to the first tokens), over a
grid of batch shapes and plans; then fit each layer kind's cost as intercept + rows + attention
pairs + aux rows + requests, and the per-batch overhead on what the layer walk leaves over.

In: a `Decoder` and a folder for the profiling chunk store. Out: `PhaseCost` per layer kind, the
per-batch overhead, and the relative TTFT error on held-out batch shapes. Requests are built like
real prompts: a cached prefix (one shared entry, like a system prompt) and several chunks of 96-512
tokens drawn from a pool of stored random-token chunks (layer cost depends on shapes, not words),
so staging opens, verifies and loads entries from the memory and disk tiers as serving does. Each
run releases its KV caches afterwards (the slab pool is in its serving steady state). Runs are
appended to a JSONL as they finish, so a stopped profile resumes. The fit minimizes relative error
(each sample weighted by 1 / its time) and drops any feature whose coefficient would come out
negative.
"""
from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cachesmith.jsonl import load_keyed
from cachesmith.kvstore import ChunkStore, StoredEntry, StoredPrompt, StoreConfig, TransferConfig, TransferEngine
from cachesmith.model import Decoder
from cachesmith.planner.cost_model import (NUM_FEATURES, BatchShape, CostModel, execution_steps, overhead_features,
                                           step_features)
from cachesmith.planner.profile import LAYER_KINDS, PASS_KINDS, PhaseCost, Profile
from cachesmith.calibration.batch_check import time_batch
from cachesmith.calibration.quiet import QuietRun
from cachesmith.recompute import BatchRunner, RecomputeConfig

ALL = 10_000  # warmup / probe depth meaning "every layer"
# (signal, warmup, probe, coverage), every layer kind and every serving family: full prefill,
# full reuse and EPIC (position), CacheBlend (kv_dev,1,0), ProphetKV (qci,0,L), FusionRAG
# (qci_last,0,L) at their usual coverages, and the planner's (S, w, p) at low to high coverage
PRESET_PLANS = (("position", ALL, 0, 1.0), ("position", 0, 0, 0.0), ("position", 0, 0, 0.15),
                ("kv_dev", 1, 0, 0.15), ("qci", 0, ALL, 0.15), ("qci_last", 0, ALL, 0.15))
PLANNER_PLANS = (("kv_dev", 1, 1, 0.05), ("qci", 1, 1, 0.3), ("kv_dev", 2, 4, 0.5), ("qci", 1, 1, 0.05),
                 ("kv_dev", 1, 1, 0.3), ("qci", 2, 4, 0.5), ("kv_dev", 1, 1, 0.8), ("qci", 1, 2, 0.15))
PROFILE_PLANS = PRESET_PLANS + PLANNER_PLANS
CHUNK_TOKENS = (96, 512)  # pool chunk sizes, like retrieved passages
PREFIX_TOKENS = 24  # the shared cached prefix (the real prompts' system part is 23-26 tokens)
SUFFIX_TOKENS = (16, 48)
DECODE_ROWS = 8  # cache rows each timed request reserves past its prompt, as a served one does for decoding


@dataclass(frozen=True)
class Sample:
    kind: str
    features: tuple[float, ...]
    seconds: float


@dataclass(frozen=True)
class RunSpec:
    """One timed run: per-request context targets (tokens), a plan, and the seed drawing its chunks."""
    contexts: tuple[int, ...]
    plan: tuple[str, int, int, float]
    seed: int

    @property
    def key(self) -> str:
        return f"{','.join(map(str, self.contexts))}|{','.join(map(str, self.plan))}|{self.seed}"


@dataclass(frozen=True)
class RunTiming:
    shape: BatchShape
    plan: tuple[str, int, int, float]
    total_s: float  # staging to the first tokens, as serving measures a batch
    layer_s: float  # the layer passes alone
    samples: tuple[Sample, ...]
    stall_s: float = 0.0  # waiting on KV loads (inside total_s, outside layer_s)
    selected: tuple[int, ...] = ()  # context rows each request recomputed (EPIC's skip its first chunk)
    process: str = ""  # the profiling process that timed it: the machine's speed drifts between them

    def scaled(self, factor: float) -> "RunTiming":
        """Every time divided by `factor` (a process `factor` x slower than the reference)."""
        return replace(self, total_s=self.total_s / factor, layer_s=self.layer_s / factor,
                       stall_s=self.stall_s / factor,
                       samples=tuple(replace(x, seconds=x.seconds / factor) for x in self.samples))

    @property
    def coverages(self) -> np.ndarray:
        """[1, R] coverage each request really ran at (the plan's where not recorded)."""
        c = np.asarray(self.shape.context_tokens, float)
        if self.selected:
            return (np.asarray(self.selected, float) / c)[None, :]
        return np.full((1, len(c)), self.plan[3])

    def to_record(self, key: str) -> dict:
        s = self.shape
        return {"key": key, "contexts": list(s.context_tokens), "suffix": list(s.suffix_tokens),
                "prefix": list(s.prefix_tokens), "plan": list(self.plan), "total_s": self.total_s,
                "layer_s": self.layer_s, "stall_s": self.stall_s, "selected": list(self.selected),
                "process": self.process, "passes": [[x.kind, x.seconds] for x in self.samples]}

    @classmethod
    def from_record(cls, rec: dict, num_layers: int) -> "RunTiming":
        shape = BatchShape(tuple(rec["contexts"]), tuple(rec["suffix"]), tuple(rec["prefix"]))
        plan, selected = tuple(rec["plan"]), tuple(rec.get("selected") or ())
        return cls(shape, plan, rec["total_s"], rec["layer_s"],
                   _samples(shape, plan, num_layers, [s for _, s in rec["passes"]], selected),
                   rec.get("stall_s", 0.0), selected, rec.get("process", ""))


def plan_config(spec: tuple, num_layers: int) -> RecomputeConfig:
    signal, w, p, r = spec
    w = min(w, num_layers)
    return RecomputeConfig(signal, w, min(p, num_layers - w), r)


def _samples(shape: BatchShape, spec: tuple, num_layers: int, seconds: list[float],
             selected: tuple[int, ...] = ()) -> tuple[Sample, ...]:
    plan = plan_config(spec, num_layers)
    steps = execution_steps(plan.signal.value, plan.warmup, plan.probe, num_layers)
    if len(steps) != len(seconds):
        raise RuntimeError(f"runner made {len(seconds)} layer passes, the cost model expects {len(steps)}")
    cov = RunTiming(shape, tuple(spec), 0.0, 0.0, (), 0.0, tuple(selected)).coverages
    return tuple(Sample(step.kind, tuple(step_features(step.kind, shape, cov, step.places)[0]), s)
                 for step, s in zip(steps, seconds))


class TimingBench:
    """The serving path for timing: a `ChunkStore` (memory and disk tiers, the disk under `root`)
    holding a pool of random-token chunks and a shared prefix, a long-lived `TransferEngine` and a
    `BatchRunner`. The pool is stored once (kept on disk: a second profile reuses it) and read once
    before timing, so its files are page-cached as a serving store's are."""

    def __init__(self, model: Decoder, root: Path, num_chunks: int = 96, seed: int = 0,
                 store: StoreConfig | None = None, transfer: TransferConfig | None = None,
                 chunk_tokens: tuple[int, int] = CHUNK_TOKENS, show_progress: bool = False) -> None:
        self.model = model
        self.process = f"{os.getpid()}@{time.time():.0f}"  # runs timed by this process
        self.store = ChunkStore(store or StoreConfig(root=Path(root)))
        self.transfer = TransferEngine(self.store, model, transfer)
        self.runner = BatchRunner(model)
        rng, vocab = random.Random(f"pool-{seed}"), model.config.vocab_size
        self.prefix_key = self.store.ensure(model, [rng.randrange(vocab) for _ in range(PREFIX_TOKENS)])[0]
        self.pool: list[tuple[str, int]] = []
        for _ in tqdm(range(num_chunks), desc="profiling chunk pool", unit="chunk", disable=not show_progress):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(*chunk_tokens))]
            self.pool.append((self.store.ensure(model, ids)[0], len(ids)))
        for key, _ in self.pool:  # page-cache every entry (and fill the memory tier as far as it holds)
            self.store.get(key, model)

    def close(self) -> None:
        self.transfer.close()

    def requests(self, contexts: Iterable[int], seed: int) -> tuple[list[StoredPrompt], BatchShape]:
        """Requests of about `contexts` chunk tokens each: pool chunks drawn without replacement
        within a batch (while the pool lasts), a prefix and a random suffix each."""
        rng, vocab = random.Random(seed), self.model.config.vocab_size
        order = rng.sample(range(len(self.pool)), len(self.pool))
        reqs, ctx, sfx = [], [], []
        for target in contexts:
            chunks, n = [], 0
            while n < target:
                if not order:
                    order = rng.sample(range(len(self.pool)), len(self.pool))
                key, size = self.pool[order.pop()]
                chunks.append(StoredEntry(key, size))
                n += size
            suffix = tuple(rng.randrange(vocab) for _ in range(rng.randint(*SUFFIX_TOKENS)))
            reqs.append(StoredPrompt(tuple(chunks), suffix, StoredEntry(self.prefix_key, PREFIX_TOKENS)))
            ctx.append(n)
            sfx.append(len(suffix))
        return reqs, BatchShape(tuple(ctx), tuple(sfx), (PREFIX_TOKENS,) * len(ctx))

    def time_run(self, contexts: Iterable[int], spec: tuple, seed: int) -> RunTiming:
        """One batch timed as `BatchExecutor._timed_run` times it, with the layer passes recorded."""
        prompts, shape = self.requests(contexts, seed)
        plan = plan_config(spec, self.model.num_layers)
        total, stall, passes, selected = time_batch(self.transfer, self.runner, prompts, plan, DECODE_ROWS)
        return RunTiming(shape, tuple(spec), total, sum(passes),
                         _samples(shape, spec, self.model.num_layers, passes, tuple(selected)),
                         stall, tuple(selected), self.process)


def timed_quietly(bench: TimingBench, contexts, spec: tuple, seed: int, gate: Callable[[], QuietRun] | None,
                  attempts: int = 3) -> tuple[RunTiming, dict]:
    """(run, its quiet record) of one timed batch. With `gate`, the run waits for a quiet machine
    and is timed again while another process joined it (up to `attempts` times); the least
    disturbed attempt is kept. Without one: the run and {}."""
    if gate is None:
        return bench.time_run(contexts, spec, seed), {}
    best = None
    for _ in range(attempts):
        with gate() as quiet:
            run = bench.time_run(contexts, spec, seed)
        if best is None or (quiet.other or 0.0) < (best[1]["other"] or 0.0):
            best = (run, quiet.record())
        if quiet.is_quiet:
            break
    return best


def measure(bench: TimingBench, specs: list[RunSpec], cache: Path | None = None,
            show_progress: bool = True, gate: Callable[[], QuietRun] | None = None,
            attempts: int = 3) -> list[RunTiming]:
    """Time every spec (one untimed warm-up run first); with `cache`, runs already in that JSONL
    are read back and each new one is appended as it finishes. With `gate` (a `QuietRun` maker,
    for a shared machine) each run waits for a quiet machine, and one another process joined is
    timed again (up to `attempts` times; the least disturbed attempt is kept, marked); a later
    call times the disturbed ones again."""
    L = bench.model.num_layers
    done = load_keyed(cache) if cache is not None else {}
    todo = [s for s in specs if s.key not in done or (gate is not None and done[s.key].get("is_quiet") is False)]
    if todo:
        bench.time_run(todo[0].contexts, ("position", 0, 0, 0.0), todo[0].seed)  # warm-up: allocator, slabs
    sink = open(cache, "a", encoding="utf-8") if cache is not None else None
    try:
        for spec in tqdm(todo, desc="profile costs", unit="run", disable=not show_progress):
            run, quiet = timed_quietly(bench, spec.contexts, spec.plan, spec.seed, gate, attempts)
            done[spec.key] = {**run.to_record(spec.key), **quiet}
            if sink is not None:
                sink.write(json.dumps(done[spec.key]) + "\n")
                sink.flush()
    finally:
        if sink is not None:
            sink.close()
    return [RunTiming.from_record(done[s.key], L) for s in specs]


def fit_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative least squares with non-negative coefficients (each sample weighted by 1 / y)."""
    w = 1.0 / np.maximum(y, 1e-6)
    return _nonnegative(x * w[:, None], y * w)


def scaffold(costs: dict[str, PhaseCost], overhead: PhaseCost, num_layers: int, kv_bytes: int,
              bandwidth_gbps: float | None) -> CostModel:
    profile = Profile("fit", "fit", "fit", "fit", num_layers, kv_bytes, costs, overhead,
                      {"fit": bandwidth_gbps or 1e6})
    return CostModel(profile)


def predicted_ttft(model: CostModel, run: RunTiming) -> float:
    """The cost model's TTFT for a run, at the coverages its requests really ran at."""
    plan = plan_config(run.plan, model.num_layers)
    return float(model.ttft(run.shape, plan.signal.value, plan.warmup, plan.probe, run.coverages)[0])


NF = NUM_FEATURES


def design_row(run: RunTiming, num_layers: int) -> np.ndarray:
    """A run's TTFT as a linear function of every coefficient (its passes' features summed per
    kind, the selection's, the overhead's), the link aside: [len(LAYER_KINDS) * 5 + 5]."""
    plan = plan_config(run.plan, num_layers)
    steps = execution_steps(plan.signal.value, plan.warmup, plan.probe, num_layers)
    row = np.zeros(len(LAYER_KINDS) * NF + NF)
    for step, sample in zip(steps, run.samples):
        k = LAYER_KINDS.index(step.kind)
        row[k * NF:(k + 1) * NF] += sample.features
        if step.selects:
            k = LAYER_KINDS.index("select")
            row[k * NF:(k + 1) * NF] += step_features("select", run.shape, run.coverages)[0]
    row[len(LAYER_KINDS) * NF:] = overhead_features(run.shape)[0]
    return row


def fit_costs(runs: list[RunTiming], num_layers: int, pass_weight: float = 1.0,
              num_rounds: int = 8) -> tuple[dict[str, PhaseCost], PhaseCost]:
    """Every layer kind's cost, the selection's and the per-batch overhead, fit together to the
    runs' TTFTs (relative least squares, non-negative), each pass's own time held to its kind's
    cost too, with `pass_weight` per run shared by its passes. The TTFTs decide: between passes
    the runner selects, plans the Patch rows and issues loads, and the loader threads share the
    cores with the passes they overlap (a batch's first Patch pass ran up to 3x the others), so
    per-pass times alone priced whole batches 10% off in either direction, by family. Each run's
    measured wait on KV loads comes off its TTFT first: the cost model's link walk prices waits.
    Runs of several profiling processes are brought to one speed first: this machine
    ran 7% faster to 17% slower from one process to the next (`process_factors`, re-fit
    `num_rounds` times); the costs are at the runs' geometric-mean speed."""
    factors: dict[str, float] = {}
    costs, overhead = _fit_once([r.scaled(factors.get(r.process, 1.0)) for r in runs], num_layers, pass_weight)
    if len({r.process for r in runs}) > 1:
        for _ in range(num_rounds - 1):
            model = scaffold(costs, overhead, num_layers, 1, None)
            factors = process_factors(runs, model)
            costs, overhead = _fit_once([r.scaled(factors[r.process]) for r in runs], num_layers, pass_weight)
    return costs, overhead


def process_factors(runs: list[RunTiming], model: CostModel) -> dict[str, float]:
    """Per process, its median measured / predicted TTFT, over their geometric mean across runs."""
    ratios: dict[str, list[float]] = {}
    for r in runs:
        ratios.setdefault(r.process, []).append(r.total_s / predicted_ttft(model, r))
    factors = {s: float(np.median(v)) for s, v in ratios.items()}
    level = float(np.exp(np.mean([np.log(factors[r.process]) for r in runs])))
    return {s: f / level for s, f in factors.items()}


def _fit_once(runs: list[RunTiming], num_layers: int, pass_weight: float) -> tuple[dict[str, PhaseCost], PhaseCost]:
    for kind in PASS_KINDS:
        if not any(s.kind == kind for r in runs for s in r.samples):
            raise ValueError(f"no layer passes of kind {kind!r} were measured; widen the plan grid")
    width = len(LAYER_KINDS) * NF + NF
    rows, ys, ws = [], [], []
    for r in runs:
        rows.append(design_row(r, num_layers))
        ys.append(r.total_s - r.stall_s)
        ws.append(1.0 / r.total_s)
        for sample in r.samples:
            k = LAYER_KINDS.index(sample.kind)
            row = np.zeros(width)
            row[k * NF:(k + 1) * NF] = sample.features
            rows.append(row)
            ys.append(sample.seconds)
            ws.append(pass_weight / np.sqrt(len(r.samples)) / max(sample.seconds, 1e-4))
    w = np.array(ws)
    coef = _nonnegative(np.array(rows) * w[:, None], np.array(ys) * w)
    costs = {k: PhaseCost(*map(float, coef[i * NF:(i + 1) * NF])) for i, k in enumerate(LAYER_KINDS)}
    return costs, PhaseCost(*map(float, coef[len(LAYER_KINDS) * NF:]))


def _nonnegative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a c - b| over c >= 0 on the columns that are not all zero (drop the most negative, refit)."""
    active = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    out = np.zeros(a.shape[1])
    while active:
        coef, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (coef >= 0).all():
            out[active] = coef
            return out
        active.pop(int(np.argmin(coef)))
    return out


HELD_OUT = ((384, 1536), (768, 768, 256), (1280,), (640, 320, 960, 512), (2200, 1700, 900, 2400, 1300))
VALIDATION_PLANS = (("qci", 2, 2, 0.15), ("kv_dev", 2, 1, 0.4), ("position", ALL, 0, 1.0), ("position", 0, 0, 0.15))


def validation_error(bench: TimingBench, model: CostModel, shapes=HELD_OUT, plans=VALIDATION_PLANS,
                     seed: int = 99, repeats: int = 1, gate: Callable[[], QuietRun] | None = None,
                     attempts: int = 3) -> list[dict]:
    """Measured vs predicted TTFT (at the coverages the requests really ran) on batch shapes the
    fit never saw, each row with its run's record (`RunTiming.to_record`: the shape and selection,
    so a refit can be checked on the same runs). With `gate`, as `timed_quietly`."""
    L = bench.model.num_layers
    rows = []
    for i, contexts in enumerate(shapes):
        for spec in plans:
            runs = [timed_quietly(bench, contexts, spec, seed + i, gate, attempts)[0] for _ in range(repeats)]
            measured = float(np.median([r.total_s for r in runs]))
            predicted = predicted_ttft(model, runs[0])
            rows.append({"contexts": list(runs[0].shape.context_tokens), "plan": plan_config(spec, L).label(),
                         "measured_s": measured, "predicted_s": predicted,
                         "rel_err": abs(predicted - measured) / measured, "run": runs[0].to_record("")})
    return rows


def relative_errors(runs: list[RunTiming], model: CostModel) -> list[float]:
    """Signed predicted / measured - 1 of each run's total."""
    return [predicted_ttft(model, r) / r.total_s - 1 for r in runs]


__all__ = ["ALL", "PROFILE_PLANS", "RunSpec", "RunTiming", "Sample", "TimingBench", "design_row",
           "fit_costs", "fit_relative", "scaffold", "timed_quietly", "measure", "plan_config",
           "predicted_ttft", "relative_errors", "process_factors", "validation_error"]
