"""How well a profile prices the batches the engine really serves, term by term.

In: a `RagPipeline` (its store, transfer engine and runner: the serving path), stored prompts of a
workload, a `CostModel`, and the batches to time (requests and a plan each). Out: one
`CheckedBatch` per batch: its TTFT as serving times it (staging to the first tokens) against the
cost model's price at the batch's shape, plan and the coverages its requests really ran at, and
the same split by term (each layer kind's passes, the time between them: staging, assembly,
selection and the per-batch work, and waits on KV loads), so a wrong price names its term.
`summary` gives each family's error and the term that moves it most; `check_repeated` times a
batch several times and prices it against the median, so the price's bias shows apart from the
machine's noise.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachesmith.kvstore import StoredPrompt, TransferEngine
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import BatchShape, CostModel, execution_steps, phase_seconds, step_features
from cachesmith.recompute import BatchRunner, HookChain, LayerStatsRecorder, RecomputeConfig

BETWEEN = "between passes"  # staging, assembly, selection and the per-batch work around the passes
STALL = "KV load wait"


def family(signal: str, warmup: int, probe: int) -> str:
    """A plan family's name: signal/warm-up/probe, each depth as 0 or 1 (full prefill: position/1/0)."""
    return f"{signal}/{min(warmup, 1)}/{min(probe, 1)}"


def plan_family(plan: RecomputeConfig) -> str:
    """`family`, with full reuse (no warm-up, no probe, nothing recomputed) apart: it is the plan
    every feasibility term is priced at, and its passes' mix differs from any plan that recomputes."""
    if plan.warmup == 0 and plan.probe == 0 and plan.coverage == 0:
        return "full_reuse"
    return family(plan.signal.value, plan.warmup, plan.probe)


@dataclass(frozen=True)
class CheckedBatch:
    family: str
    plan: str
    shape: BatchShape
    measured_s: float
    predicted_s: float
    terms: dict[str, tuple[float, float]]  # term -> (measured s, predicted s)

    @property
    def rel_err(self) -> float:
        return self.predicted_s / self.measured_s - 1

    def to_dict(self) -> dict:
        return {"family": self.family, "plan": self.plan, "num_requests": self.shape.num_requests,
                "num_tokens": self.shape.num_tokens, "measured_s": self.measured_s,
                "predicted_s": self.predicted_s, "rel_err": self.rel_err,
                "terms": {k: {"measured_s": m, "predicted_s": p} for k, (m, p) in self.terms.items()}}


def shape_of(prompts: Sequence[StoredPrompt]) -> BatchShape:
    return BatchShape(tuple(p.num_context_tokens for p in prompts), tuple(len(p.suffix_ids) for p in prompts),
                      tuple(p.num_prefix_tokens for p in prompts))


def time_batch(transfer: TransferEngine, runner: BatchRunner, prompts: Sequence[StoredPrompt],
               plan: RecomputeConfig, max_new_tokens: int = 16) -> tuple[float, float, list[float], list[int]]:
    """(seconds from staging to the first tokens, of them waiting on KV loads, each layer pass's
    seconds, context rows each request recomputed) of one batch, run as `BatchExecutor` runs a
    static plan: staged from the store by the transfer engine, whose loader threads share the
    cores with the passes they overlap. Its caches are released after, as serving does once it
    has decoded."""
    rec = LayerStatsRecorder(runner.model.device)
    start = time.perf_counter()
    with transfer.stage(list(prompts), plan, [max_new_tokens] * len(prompts)) as staged:
        outs = runner.run(staged.requests, plan, HookChain(staged, rec))
        for out in outs:
            out.first_token  # reading the argmax synchronizes with the device
        total, stall = time.perf_counter() - start, staged.stall_s
    selected = [int(out.selected.numel()) for out in outs]
    for out in outs:
        out.cache.release()
    return total, stall, [s.seconds for s in rec.stats], selected


def predicted_terms(cost: CostModel, shape: BatchShape, plan: RecomputeConfig,
                    coverages: np.ndarray) -> tuple[float, dict[str, float], list[float]]:
    """(TTFT, each layer kind's passes' seconds, each pass's seconds) the cost model prices."""
    steps = execution_steps(plan.signal.value, plan.warmup, plan.probe, cost.num_layers)
    costs = cost.profile.layer_costs
    per_pass = [float(phase_seconds(costs[s.kind], step_features(s.kind, shape, coverages, s.places))[0])
                for s in steps]
    by_kind: dict[str, float] = {}
    for step, seconds in zip(steps, per_pass):
        by_kind[step.kind] = by_kind.get(step.kind, 0.0) + seconds
    ttft = float(cost.ttft(shape, plan.signal.value, plan.warmup, plan.probe, coverages)[0])
    return ttft, by_kind, per_pass


def check_batch(pipe: RagPipeline, cost: CostModel, prompts: Sequence[StoredPrompt],
                plan: RecomputeConfig) -> CheckedBatch:
    """One batch timed on the serving path and priced by `cost`, term by term."""
    shape = shape_of(prompts)
    total, stall, passes, selected = time_batch(pipe.transfer, pipe.runner, prompts, plan)
    coverages = (np.asarray(selected, float) / np.maximum(np.asarray(shape.context_tokens, float), 1))[None, :]
    steps = execution_steps(plan.signal.value, plan.warmup, plan.probe, cost.num_layers)
    if len(steps) != len(passes):
        raise RuntimeError(f"runner made {len(passes)} layer passes, the cost model expects {len(steps)}")
    ttft, by_kind, per_pass = predicted_terms(cost, shape, plan, coverages)
    measured: dict[str, float] = {}
    for step, seconds in zip(steps, passes):
        measured[step.kind] = measured.get(step.kind, 0.0) + seconds
    terms = {f"{kind} passes": (measured[kind], by_kind[kind]) for kind in by_kind}
    predicted_between = max(ttft - sum(per_pass), 0.0)  # overhead, selection, and link waits it prices
    terms[BETWEEN] = (max(total - sum(passes) - stall, 0.0), predicted_between)
    terms[STALL] = (stall, 0.0)
    return CheckedBatch(plan_family(plan), plan.label(), shape, total, ttft, terms)


def check_repeated(pipe: RagPipeline, cost: CostModel, prompts: Sequence[StoredPrompt], plan: RecomputeConfig,
                   repeats: int) -> tuple[CheckedBatch, list[float]]:
    """One batch timed `repeats` times in a row: the check of its median run (its price against
    the median time: the price's bias apart from the machine's noise, which one timing cannot
    separate) and every run's seconds (the batch's own repeat spread)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    runs = [check_batch(pipe, cost, prompts, plan) for _ in range(repeats)]
    order = sorted(range(repeats), key=lambda i: runs[i].measured_s)
    return runs[order[(repeats - 1) // 2]], [r.measured_s for r in runs]


def repeat_spread(times: Sequence[Sequence[float]]) -> float:
    """Median |time / its batch's median - 1| over every run of every batch: how closely identical
    batches repeat, the floor under any price of one timing."""
    devs = [abs(t / statistics.median(ts) - 1) for ts in times for t in ts]
    return float(np.median(devs)) if devs else float("nan")


def _abs_quantile(errs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.abs(errs), q)) if errs else float("nan")


def summary(batches: Sequence[CheckedBatch], min_batches: int = 1,
            paced: Sequence[float] | None = None) -> list[dict]:
    """Per family: batches, median and p90 |relative error|, the signed median, and the term whose
    (predicted - measured) moves the TTFT most, as a share of the measured TTFT (its median).
    `paced`: each batch's error at the price the serving planner would put on it (the cost model
    times the pace it learned from the batches before), summarized beside."""
    rows = []
    for name in sorted({b.family for b in batches}):
        mine = [b for b in batches if b.family == name]
        errs = [b.rel_err for b in mine]
        learned = [e for b, e in zip(batches, paced or ()) if b.family == name]
        shares = {term: statistics.median((b.terms[term][1] - b.terms[term][0]) / b.measured_s
                                          for b in mine if term in b.terms)
                  for term in {t for b in mine for t in b.terms}}
        worst = max(shares, key=lambda t: abs(shares[t]))
        rows.append({"family": name, "batches": len(mine), "median_abs_rel_err": _abs_quantile(errs, 0.5),
                     "p90_abs_rel_err": _abs_quantile(errs, 0.9), "median_rel_err": float(np.median(errs)),
                     "worst_term": worst, "worst_term_share": shares[worst],
                     "term_shares": {t: round(v, 4) for t, v in sorted(shares.items())},
                     "paced_median_abs_rel_err": _abs_quantile(learned, 0.5),
                     "paced_p90_abs_rel_err": _abs_quantile(learned, 0.9),
                     "is_counted": len(mine) >= min_batches})
    return rows
