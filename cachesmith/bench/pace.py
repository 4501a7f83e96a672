"""This machine as the simulator runs it: each plan family's pace (measured / predicted compute),
per batch size in prompt tokens, plus the costs the offline cost fit does not price (placing
cached rows, a per-batch overhead), so the simulator's clock runs at the machine's speed.

The fit is biased per family (on the packaged model, QCI plans ran at ~0.7x their prediction and
CacheBlend's at ~1.1x in replay), and the replay engine's planner learns that bias while serving
(`Planner.observe`); a simulator on the raw cost model would hand CacheSmith and every baseline
the wrong budgets. A family is (signal, whether it warms up, whether it probes): every preset is
one, CacheSmith's plans are two (kv_dev and qci with w, p >= 1). Reuse is not free on a CPU:
every Patch pass rotates and copies every cached row of every request into place, and the rows
were staged from the store by threads that share the cores, so a batch of several long requests
at low coverage ran 1.5-2x its predicted time. `fit_machine` fits all terms to the batches of
replays (`trace_batches`); `measure_paces` times single requests alone; `paced_errors` replays the
planner's learned pace over a replay's batches (how far the price serving puts on them errs).
In: a `RagPipeline`, the `Profile`, workload instances, or replay records. Out: a `MachinePace`.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cachesmith.bench.outcomes import fixed_plans
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchShape, CostModel, Profile
from cachesmith.planner.cost_model import execution_steps
from cachesmith.planner.pace import PaceBook
from cachesmith.calibration.batch_check import family
from cachesmith.calibration.costs import fit_relative
from cachesmith.calibration.packaged import rescaled
from cachesmith.recompute import RecomputeConfig, parse_label, preset
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.prompts import instance_prompt

PLANNER_PLANS = ((1, 1, 0.3), (1, 1, 0.7), (2, 4, 0.4))  # (w, p, r) the planner typically picks


def calibration_plans(num_layers: int) -> list[RecomputeConfig]:
    """The outcome tables' fixed plans and a few plans of the planner's."""
    return fixed_plans(num_layers) + [RecomputeConfig(s, w, p, r) for s in ("kv_dev", "qci")
                                      for w, p, r in PLANNER_PLANS if w + p < num_layers]


def measure_paces(pipe: RagPipeline, profile: Profile, instances: list[WorkloadInstance], out: Path,
                  num_repeats: int = 2, show_progress: bool = True) -> dict[str, float]:
    """Median measured/predicted TTFT per family over `instances` x plans (best of `num_repeats`)."""
    out = Path(out)
    if out.exists():
        return json.loads(out.read_text(encoding="utf-8"))["paces"]
    cost = CostModel(profile)
    parts = [instance_prompt(pipe, i) for i in instances]
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


# a family's pace in batches of at least this many prompt tokens, most specific first: the
# profile's cost grid stops at 4096 tokens a batch, and the batches a burst forms (up to 8 requests
# of ~2K tokens) ran 10-50% over its extrapolation, which sets the tail of the burst
SIZE_CLASSES = ((8192, "@8k+"), (4096, "@4k+"))
MIN_BATCHES = 3  # a traced pace needs this many batches behind it


def size_keys(family_: str, num_tokens: int) -> list[str]:
    """The keys a batch's pace is looked up under, most specific first (the family itself last)."""
    return [family_ + suffix for least, suffix in SIZE_CLASSES if num_tokens >= least] + [family_]


@dataclass(frozen=True)
class MachinePace:
    """`paces[family]` (or the pace of the batch's token class, `family@4k+` or `family@8k+`, where
    measured) times the profile's compute, plus, per cached row each Patch pass places,
    `reuse_per_row` times the profile's cost of recomputing a row there, plus `per_batch` times the
    profile's per-batch overhead (staging, threads, assembling the sequences: what a short batch
    pays beyond its layers). All are relative to the profile, so the machine follows its speed."""
    paces: dict[str, float] = field(default_factory=dict)
    reuse_per_row: float = 0.0
    per_batch: float = 0.0

    def key(self, family_: str, num_tokens: int) -> str:
        return next((k for k in size_keys(family_, num_tokens) if k in self.paces), family_)

    def pace(self, family_: str, num_tokens: int = 0) -> float:
        return self.paces.get(self.key(family_, num_tokens), 1.0)

    def reuse_row_s(self, base: Profile) -> float:
        """Seconds per cached row a Patch pass places, on `base`'s machine."""
        return self.reuse_per_row * base.layer_costs["patch"].per_row_s

    def profile(self, base: Profile, family_: str, num_tokens: int = 0) -> Profile:
        """`base` at the pace of this family and batch size, its Patch pass priced per placed
        cached row too."""
        paced = rescaled(base, self.pace(family_, num_tokens))
        patch = paced.layer_costs["patch"]
        aux = patch.per_aux_s + self.reuse_row_s(base)
        overhead = replace(paced.overhead, intercept_s=paced.overhead.intercept_s
                           + self.per_batch * base.overhead.intercept_s)
        return replace(paced, layer_costs={**paced.layer_costs, "patch": replace(patch, per_aux_s=aux)},
                       overhead=overhead)

    def to_dict(self) -> dict:
        return {"paces": self.paces, "reuse_per_row": self.reuse_per_row, "per_batch": self.per_batch}

    @classmethod
    def from_dict(cls, d: dict | None) -> "MachinePace":
        """From `to_dict`, or a plain {family: pace} (no reuse term)."""
        if not d:
            return cls()
        if "paces" in d:
            return cls(dict(d["paces"]), float(d.get("reuse_per_row", 0.0)), float(d.get("per_batch", 0.0)))
        return cls(dict(d))


@dataclass(frozen=True)
class TraceBatch:
    method: str
    family: str
    num_requests: int
    num_tokens: int  # prompt tokens of the whole batch
    predicted_s: float  # the profile's TTFT at the coverages the batch ended with
    reuse_s: float  # cached rows its Patch passes placed, at the profile's per-row Patch cost
    measured_s: float
    batch_s: float = 0.0  # the profile's per-batch overhead

    @property
    def key(self) -> str:
        return size_keys(self.family, self.num_tokens)[0]

    def machine_s(self, machine: MachinePace) -> float:
        """What `machine` says this batch takes (link waits aside: these traces never stalled)."""
        return (machine.pace(self.family, self.num_tokens) * self.predicted_s + machine.reuse_per_row * self.reuse_s
                + machine.per_batch * self.batch_s)


def records_by_batch(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """A bench run's error-free records grouped per batch: {(method, batch_id): records}."""
    out: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if r["error"] is None:
            out.setdefault((r["method"], r["batch_id"]), []).append(r)
    return out


def trace_batches(records: list[dict], instances: list, profile: Profile) -> list[TraceBatch]:
    """Every batch of a replay run. `records` are the bench's (one method or several: batches are
    told apart by method); `instances[request_id % len]` holds each request's token counts
    (`Outcome`s). A batch starts when the previous one ended or when its last member arrived,
    whichever is later (the replay clock idles until an arrival); its coverages are the ones it
    ended with (the runtime monitor may have lowered them)."""
    cost = CostModel(profile)
    out, prev_end = [], {}
    for (method, _), batch in sorted(records_by_batch(records).items()):
        end = batch[0]["first_token_s"]
        start = max(prev_end.get(method, 0.0), max(r["arrival_s"] for r in batch))
        prev_end[method] = end
        os_ = [instances[r["request_id"] % len(instances)] for r in batch]
        signal, w, p, _ = parse_label(batch[0]["plan"])
        shape = BatchShape(tuple(o.context_tokens for o in os_), tuple(o.suffix_tokens for o in os_),
                           tuple(o.prefix_tokens for o in os_))
        cov = np.array([[r["num_recomputed"] / max(1, r["num_context_tokens"]) for r in batch]])  # [1, R]
        num_patch = sum(s.kind == "patch" and s.places for s in execution_steps(signal, w, p, profile.num_layers))
        placed = num_patch * sum(o.context_tokens + o.prefix_tokens for o in os_)
        num_tokens = int(shape.arrays()[3].sum())
        out.append(TraceBatch(method, family(signal, w, p), len(batch), num_tokens,
                              float(cost.ttft(shape, signal, w, p, cov)[0]),
                              placed * profile.layer_costs["patch"].per_row_s, end - start,
                              profile.overhead.intercept_s))
    return out


def _fitted_keys(batches: list[TraceBatch]) -> list[str]:
    """The paces a fit can carry: a size class with `MIN_BATCHES` batches of its own; a rarer one
    lends its batches to the next coarser class (@8k+ to @4k+ to the family)."""
    groups: dict[str, int] = {}
    for b in batches:
        groups[b.key] = groups.get(b.key, 0) + 1
    keys = []
    for fam in sorted({b.family for b in batches}):
        carry = 0
        for k in size_keys(fam, max(least for least, _ in SIZE_CLASSES)):
            carry += groups.get(k, 0)
            if carry >= MIN_BATCHES:
                keys.append(k)
                carry = 0
    return keys


def fit_machine(batches: list[TraceBatch], isolated: dict[str, float] | None = None,
                is_paces_only: bool = False) -> MachinePace:
    """Each family's pace (and its size classes' where `MIN_BATCHES` batches of that size ran) and
    one reuse cost per placed row and one per-batch overhead (none with `is_paces_only`: for a
    profile that prices placed rows and the batch overhead itself), fit to `batches` by relative
    least squares (non-negative).
    Families the trace ran too rarely are left out of the fit; families it never ran take their
    `isolated` pace times the median fitted/isolated ratio (a trace runs at its own level)."""
    keys = _fitted_keys(batches)

    def key_of(b: TraceBatch) -> str | None:
        return next((k for k in size_keys(b.family, b.num_tokens) if k in keys), None)

    used = [b for b in batches if key_of(b) is not None]
    x = np.zeros((len(used), len(keys) + 2))  # [B, families + reuse + batch]
    for i, b in enumerate(used):
        x[i, keys.index(key_of(b))] = b.predicted_s
        x[i, -2:] = b.reuse_s, b.batch_s
    if is_paces_only:
        x[:, -2:] = 0.0  # their coefficients come out 0: the columns explain nothing
    coef = fit_relative(x, np.array([b.measured_s for b in used])) if used else np.zeros(2)
    fitted = {k: float(c) for k, c in zip(keys, coef) if c > 0}
    common = [fitted[k] / isolated[k] for k in fitted if isolated and k in isolated]
    level = statistics.median(common) if common else 1.0
    rest = {k: v * level for k, v in (isolated or {}).items() if k not in fitted}
    return MachinePace({**rest, **fitted}, float(coef[-2]), float(coef[-1]))


def residuals(batches: list[TraceBatch], machine: MachinePace) -> dict[str, dict]:
    """Per family, single or several requests (`@1`, `@2+`) and token class (`@4k+`, `@8k+`): median
    measured / `machine` time, and how many batches."""
    ratios: dict[str, list[float]] = {}
    for b in batches:
        key = b.family + ("@1" if b.num_requests == 1 else "@2+") + b.key.removeprefix(b.family)
        ratios.setdefault(key, []).append(b.measured_s / b.machine_s(machine))
    return {k: {"median": statistics.median(v), "num_batches": len(v)} for k, v in sorted(ratios.items())}


def fit_paces(batches: list[TraceBatch], num_layers: int) -> tuple[MachinePace, list[dict]]:
    """The paces-only machine for a format-2 profile (which prices placed rows and the batch
    overhead itself; fitting those again only trades them against the paces): a pace per family
    and size class the batches ran, the median level for the calibration families they did not.
    Also the rows {key, batches, before, after}: median measured / machine time before (paces 1)
    and after the fit."""
    families = {family(p.signal.value, p.warmup, p.probe) for p in calibration_plans(num_layers)}
    machine = fit_machine(batches, {f: 1.0 for f in families}, is_paces_only=True)
    before, after = residuals(batches, MachinePace()), residuals(batches, machine)
    rows = [{"key": k, "batches": v["num_batches"], "before": v["median"], "after": after[k]["median"]}
            for k, v in before.items()]
    return machine, rows


def paced_errors(batches: list[dict]) -> list[float]:
    """Relative error (price / measured - 1) of the price the serving planner puts on each of a
    replay's batches, in the order given (the order they ran): the cost model's prediction
    (`predicted_s`) times the pace its `PaceBook` learned from the batches before it. Each batch
    is a dict with `plan` ("(signal,w,p,r%)"), `num_tokens`, `predicted_s` and `measured_s`.
    Serving learns the pace up to the last layer run on the original plan (the runtime monitor's);
    this learns it from the whole batch."""
    book, out = PaceBook(), []
    for b in batches:
        signal, _, probe, _ = parse_label(b["plan"])
        pace = book.pace(signal, probe, b["num_tokens"])
        out.append(b["predicted_s"] * pace / b["measured_s"] - 1)
        book.observe(signal, b["measured_s"] / b["predicted_s"], probe, b["num_tokens"])
    return out
