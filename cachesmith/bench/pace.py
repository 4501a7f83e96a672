"""This machine's pace per plan family: measured / predicted TTFT of real single-request runs, so
the simulator's clock runs at the machine's speed rather than the offline cost fit's.

The fit is biased per family (on the packaged model, QCI plans ran at ~0.75x their prediction and
CacheBlend's at ~1.1x in replay), and the replay engine's planner learns that bias while serving
(`Planner.observe`); a simulator on the raw cost model would hand CacheSmith and every baseline
the wrong budgets. A family is (signal, whether it warms up, whether it probes): every preset is
one, CacheSmith's plans are two (kv_dev and qci with w, p >= 1).
In: a `RagPipeline`, the `Profile`, workload instances. Out: {family: pace}, cached as JSON.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cachesmith.bench.outcomes import fixed_plans
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchShape, CostModel, Profile
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.workloads.instance import WorkloadInstance

PLANNER_PLANS = ((1, 1, 0.3), (1, 1, 0.7), (2, 4, 0.4))  # (w, p, r) the planner typically picks


def family(signal: str, warmup: int, probe: int) -> str:
    return f"{signal}/{min(warmup, 1)}/{min(probe, 1)}"


def calibration_plans(num_layers: int) -> list[RecomputeConfig]:
    """The outcome tables' fixed plans and a few plans of the planner's."""
    return fixed_plans(num_layers) + [RecomputeConfig(s, w, p, r) for s in ("kv_dev", "qci") for w, p, r in PLANNER_PLANS
                    if w + p < num_layers]


def measure_paces(pipe: RagPipeline, profile: Profile, instances: list[WorkloadInstance], out: Path,
                  num_repeats: int = 2, show_progress: bool = True) -> dict[str, float]:
    """Median measured/predicted TTFT per family over `instances` x plans (best of `num_repeats`)."""
    out = Path(out)
    if out.exists():
        return json.loads(out.read_text(encoding="utf-8"))["paces"]
    cost = CostModel(profile)
    parts = [pipe.instance_prompt(i) for i in instances]
    pipe.answer_parts(parts[0], preset("full_prefill", 1.0, pipe.model.num_layers), 1)  # warm-up
    ratios: dict[str, list[float]] = {}
    plans = calibration_plans(pipe.model.num_layers)
    for plan in tqdm(plans, desc="pace per plan family", unit="plan", disable=not show_progress):
        for p in parts:
            measured = min(pipe.answer_parts(p, plan, 1).ttft_s for _ in range(num_repeats))
            shape = BatchShape((sum(len(c) for c in p.chunk_ids),), (len(p.suffix_ids),), (len(p.prefix_ids),))
            predicted = float(cost.ttft(shape, plan.signal.value, plan.warmup, plan.probe,
                                        np.array([plan.coverage]))[0])
            ratios.setdefault(family(plan.signal.value, plan.warmup, plan.probe), []).append(measured / predicted)
    paces = {k: statistics.median(v) for k, v in ratios.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"paces": paces, "ratios": ratios}, indent=1), encoding="utf-8")
    return paces


def trace_paces(records: list[dict], instances: list, profile: Profile,
                is_by_size: bool = False) -> dict[str, list[float]]:
    """Measured/predicted TTFT per family of every batch of a replay run. `records` are the bench's
    (one method or several: batches are told apart by method); `instances[request_id % len]` holds
    each request's token counts (`Outcome`s). A batch starts when the previous one ended or when
    its last member arrived, whichever is later (the replay clock idles until an arrival).
    `is_by_size`: keys get "@1" or "@2+" for single- and multi-request batches."""
    cost = CostModel(profile)
    by_batch: dict[tuple, list[dict]] = {}
    for r in records:
        if r["error"] is None:
            by_batch.setdefault((r["method"], r["batch_id"]), []).append(r)
    out: dict[str, list[float]] = {}
    prev_end: dict[str, float] = {}
    for (method, _), batch in sorted(by_batch.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        end = batch[0]["first_token_s"]
        start = max(prev_end.get(method, 0.0), max(r["arrival_s"] for r in batch))
        prev_end[method] = end
        os_ = [instances[r["request_id"] % len(instances)] for r in batch]
        signal, w, p, _ = batch[0]["plan"].strip("()").split(",")
        shape = BatchShape(tuple(o.context_tokens for o in os_), tuple(o.suffix_tokens for o in os_),
                           tuple(o.prefix_tokens for o in os_))
        predicted = float(cost.ttft(shape, signal, int(w), int(p), np.array([[r["coverage"] for r in batch]]))[0])
        key = family(signal, int(w), int(p)) + (("@1" if len(batch) == 1 else "@2+") if is_by_size else "")
        out.setdefault(key, []).append((end - start) / predicted)
    return out


MULTI = "@2+"  # suffix of a family's pace in batches of two or more requests
MIN_BATCHES = 3  # a traced pace needs this many batches behind it


def combine_paces(isolated: dict[str, float], in_trace: dict[str, list[float]]) -> dict[str, float]:
    """Paces from a calibration replay (`trace_paces(..., is_by_size=True)`): each family's single-
    request pace where the trace ran it, and its multi-request pace ("<family>@2+") where it ran
    batches of several; other families take the isolated pace times the median traced/isolated
    ratio (a trace runs slower or faster than single requests on a warm machine)."""
    traced = {k: statistics.median(v) for k, v in in_trace.items() if len(v) >= MIN_BATCHES}
    single = {k.removesuffix("@1"): v for k, v in traced.items() if k.endswith("@1")}
    multi = {k: v for k, v in traced.items() if k.endswith(MULTI)}
    common = [single[k] / isolated[k] for k in single if k in isolated]
    level = statistics.median(common) if common else 1.0
    return {**{k: v * level for k, v in isolated.items()}, **single, **multi}
