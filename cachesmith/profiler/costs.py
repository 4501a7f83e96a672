"""Compute cost profiling: time every layer pass of real runs over a grid of batch shapes and
plans, and fit each layer kind's cost as intercept + rows + attention pairs (+ aux rows).

In: a `Decoder` and grids. Out: `PhaseCost` per layer kind, the per-batch overhead, and the
relative TTFT error on held-out batch shapes. The fit minimizes relative error (each sample is
weighted by 1 / its time) and drops any feature whose coefficient would come out negative.
"""
from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from cachesmith.model import Decoder
from cachesmith.planner.cost_model import BatchShape, execution_steps, step_features
from cachesmith.planner.profile import LAYER_KINDS, PhaseCost
from cachesmith.profiler.synthetic import random_request
from cachesmith.recompute import BatchRunner, LayerStatsRecorder, RecomputeConfig

# (signal, warmup, probe, coverage): together they exercise every layer kind
PROFILE_PLANS = (("position", 10_000, 0, 1.0), ("qci", 1, 2, 0.05), ("qci", 1, 2, 0.3), ("qci", 1, 2, 0.6),
                 ("kv_dev", 1, 1, 0.05), ("kv_dev", 1, 1, 0.3), ("kv_dev", 1, 1, 0.6), ("qci_last", 1, 0, 0.2))


@dataclass(frozen=True)
class Sample:
    kind: str
    features: tuple[float, float, float, float]
    seconds: float


@dataclass(frozen=True)
class RunTiming:
    shape: BatchShape
    plan: tuple[str, int, int, float]
    total_s: float
    layer_s: float
    samples: tuple[Sample, ...]


def _plan(spec: tuple, num_layers: int) -> RecomputeConfig:
    signal, w, p, r = spec
    return RecomputeConfig(signal, min(w, num_layers), p, r)


def time_run(model: Decoder, runner: BatchRunner, contexts: Iterable[int], spec: tuple, seed: int,
             num_suffix: int = 32, prefix_ids: list[int] | None = None) -> RunTiming:
    rng = random.Random(seed)
    reqs = [random_request(model, prefix_ids or [], c, rng, num_suffix)[0] for c in contexts]
    plan = _plan(spec, model.num_layers)
    rec = LayerStatsRecorder(model.device)
    start = time.perf_counter()
    out = runner.run(reqs, plan, rec)
    out[-1].first_token  # reading the argmax synchronizes with the device
    total = time.perf_counter() - start
    shape = BatchShape(tuple(int(c) for c in contexts), (num_suffix,) * len(reqs),
                       (len(prefix_ids or []),) * len(reqs))
    steps = execution_steps(plan.signal.value, plan.warmup, plan.probe, model.num_layers)
    if len(steps) != len(rec.stats):
        raise RuntimeError(f"runner made {len(rec.stats)} layer passes, the cost model expects {len(steps)}")
    cov = np.full((1, len(reqs)), plan.coverage)
    samples = tuple(Sample(step.kind, tuple(step_features(step.kind, shape, cov)[0]), stat.seconds)
                    for step, stat in zip(steps, rec.stats))
    return RunTiming(shape, spec, total, rec.total_seconds(), samples)


def measure(model: Decoder, shapes: list[tuple[int, ...]], plans=PROFILE_PLANS, seed: int = 0,
            show_progress: bool = True) -> list[RunTiming]:
    runner = BatchRunner(model)
    time_run(model, runner, shapes[0], plans[0], seed)  # warm-up: allocator, kernels
    jobs = [(s, p) for s in shapes for p in plans]
    out = []
    for i, (contexts, spec) in enumerate(tqdm(jobs, desc="profile costs", unit="run", disable=not show_progress)):
        out.append(time_run(model, runner, contexts, spec, seed + i))
    return out


def fit_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative least squares with non-negative coefficients (drop negative features, refit)."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while True:
        w = 1.0 / np.maximum(y, 1e-6)
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            out = np.zeros(x.shape[1])
            out[active] = np.maximum(coef, 0)
            return out
        active.pop(int(np.argmin(coef)))


def fit_costs(runs: list[RunTiming]) -> tuple[dict[str, PhaseCost], PhaseCost]:
    costs = {}
    for kind in LAYER_KINDS:
        rows = [(s.features, s.seconds) for r in runs for s in r.samples if s.kind == kind]
        if not rows:
            raise ValueError(f"no layer passes of kind {kind!r} were measured; widen the plan grid")
        x = np.array([f for f, _ in rows])
        y = np.array([t for _, t in rows])
        costs[kind] = PhaseCost(*map(float, fit_relative(x, y)))
    over_x = np.array([[1.0, sum(c + q + p for c, q, p in zip(r.shape.context_tokens, r.shape.suffix_tokens,
                                                               r.shape.prefix_tokens)), 0.0, 0.0] for r in runs])
    over_y = np.array([max(r.total_s - r.layer_s, 1e-6) for r in runs])
    return costs, PhaseCost(*map(float, fit_relative(over_x, over_y)))


def default_shapes(max_tokens: int = 4096) -> list[tuple[int, ...]]:
    shapes = [(c,) * b for c in (256, 512, 1024, 2048) for b in (1, 2, 4) if b * c <= max_tokens]
    return shapes


HELD_OUT = ((384, 1536), (768, 768, 256), (1280,), (640, 320, 960, 512))


def validation_error(model: Decoder, predict, shapes=HELD_OUT, plans=(("qci", 2, 2, 0.15), ("kv_dev", 2, 1, 0.4),
                                                                     ("position", 10_000, 0, 1.0)),
                     seed: int = 99, repeats: int = 1) -> list[dict]:
    """Measured vs predicted TTFT on batch shapes the fit never saw. `predict(shape, plan)` -> s."""
    runner = BatchRunner(model)
    rows = []
    for i, contexts in enumerate(shapes):
        for spec in plans:
            runs = [time_run(model, runner, contexts, spec, seed + i) for _ in range(repeats)]
            measured = float(np.median([r.total_s for r in runs]))
            predicted = predict(runs[0].shape, _plan(spec, model.num_layers))
            rows.append({"contexts": list(contexts), "plan": _plan(spec, model.num_layers).label(),
                         "measured_s": measured, "predicted_s": predicted,
                         "rel_err": abs(predicted - measured) / measured})
    return rows
