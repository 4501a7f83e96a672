"""Outcome tables: whether each workload instance passes its quality gate under each plan,
measured once with the real engine, so the simulator can replay quality without a model.

In: a `RagPipeline` and workload instances. Out: an `OutcomeTable`: per instance its token counts,
layer-0 QCI entropy, the verdict of full prefill, full reuse and every baseline preset at its
coverages, and per (signal, anchor rank depth) the coverage at which its verdict flips from the
full-reuse-side value to the full-prefill value (5% grid, binary search, one flip assumed; p = 1 as
in the demand profile). An instance's plans are measured together, ranked once per (S, w, p) and
decoded in one batch (`calibration.verdicts`). Every evaluated (instance, plan) is appended to a JSONL
cache, so a stopped run resumes; a progress bar counts instances.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from tqdm import tqdm

from cachesmith.errors import InputError
from cachesmith.methods import DEFAULT_COVERAGES, SELECTIVE, parse_method
from cachesmith.model.assets import cachesmith_home
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import NEVER, DemandCurve
from cachesmith.calibration.demand import SIGNALS, DemandProfiler, anchor_depths, fit_threshold, flip_interval, task_curves
from cachesmith.calibration.subjects import Subject
from cachesmith.recompute import FIXED_FAMILIES, RecomputeConfig, fixed_splits, parse_label, preset
from cachesmith.workloads.card import instance_digest
from cachesmith.instance import WorkloadInstance
from cachesmith.profiler.subjects import instance_subject
from cachesmith.workloads.tasks import generate


SHALLOW = ("kv_dev", 1, 0)  # CacheBlend's family: the planner's rank depth 1 (scores at layer w = 1)
# CacheBlend's family also below its presets' coverages: a burst's budgets often fit only 5-10%,
# and unmeasured coverages read as full reuse's verdict, so rank depth 1 would never be planned there
SHALLOW_COVERAGES = (0.05, 0.10)
# the fixed-split families (`recompute.FIXED_FAMILIES`: the last-layer family, which on multi-hop
# questions matched full prefill's gate where KV deviation and QCI did not, and the fused family)
LAST_COVERAGES = (0.05, 0.10, 0.15, 0.30)


def fixed_families(num_layers: int) -> list[tuple[str, int, int]]:
    """The (S, w, p) of each fixed-split family on a model of `num_layers`."""
    return [(s, *split) for s, split in fixed_splits(num_layers).items()]


@dataclass(frozen=True)
class Flip:
    """Verdict along coverage at one (signal, depth): `low` below `at`, `high` (full prefill's) from it."""
    low: bool
    high: bool
    at: float  # coverage of the first grid step with the `high` verdict (1.0 when low == high)

    def passes(self, coverage: float) -> bool:
        return self.high if coverage >= self.at - 1e-9 else self.low


@dataclass
class Outcome:
    digest: str
    task: str
    seed: int
    prefix_tokens: int
    context_tokens: int
    suffix_tokens: int
    max_new_tokens: int
    entropy: float
    plans: dict[str, bool]  # RecomputeConfig.label() -> verdict, for the measured fixed plans
    flips: dict[str, Flip] = field(default_factory=dict)  # "signal/depth" -> Flip

    @property
    def num_tokens(self) -> int:
        return self.prefix_tokens + self.context_tokens + self.suffix_tokens

    @cached_property
    def static(self) -> dict[tuple[str, int, int], list[tuple[float, bool]]]:
        """The measured fixed plans by (signal, w, p): [(coverage, verdict)] in coverage order."""
        out: dict[tuple[str, int, int], list[tuple[float, bool]]] = {}
        for label, verdict in self.plans.items():
            s, w, p, c = parse_label(label)
            out.setdefault((s, w, p), []).append((c, verdict))
        return {k: sorted(v) for k, v in out.items()}

    @cached_property
    def anchors(self) -> dict[str, list[int]]:
        """The anchor depths of each signal's flips, ascending."""
        out: dict[str, list[int]] = {}
        for key in self.flips:
            s, d = key.split("/")
            out.setdefault(s, []).append(int(d))
        return {s: sorted(v) for s, v in out.items()}


def fixed_plans(num_layers: int, coverages=DEFAULT_COVERAGES) -> list[RecomputeConfig]:
    """Full prefill, full reuse, every selective preset at each baseline coverage and CacheBlend's
    family at the shallow coverages below them, and the fixed-split families (`fixed_families`)."""
    plans = [preset("full_prefill", 1.0, num_layers), preset("full_reuse", 0.0, num_layers)]
    shallow = [RecomputeConfig(*SHALLOW, c) for c in SHALLOW_COVERAGES if c not in coverages]
    last = [make(c, num_layers) for make in FIXED_FAMILIES.values() for c in LAST_COVERAGES]
    return plans + [preset(p, c, num_layers) for p in SELECTIVE for c in coverages] + shallow + last


class OutcomeMeasurer:
    """Measures `Outcome`s with the real pipeline, through a resumable JSONL cache of verdicts."""

    def __init__(self, pipe: RagPipeline, cache_path: Path) -> None:
        # the demand profiler's cache and evaluation, with the instance's whole answer length:
        # the gate reads every answer token the engine would decode
        self.profiler = DemandProfiler(pipe, Path(cache_path), max_new_tokens=1 << 30)
        self.pipe = pipe
        self.num_layers = pipe.model.num_layers

    def verdicts(self, inst: WorkloadInstance, plans: list[RecomputeConfig]) -> dict[str, bool]:
        """label -> verdict of each plan, measured together."""
        return self._verdicts(instance_subject(self.pipe, inst), plans)

    def _verdicts(self, subject: Subject, plans: list[RecomputeConfig]) -> dict[str, bool]:
        records = self.profiler.measure(subject, [(p, p.label()) for p in plans])
        return {p.label(): bool(r["passed"]) for p, r in zip(plans, records)}

    def plans(self, is_flips_only: bool) -> list[RecomputeConfig]:
        """The fixed plans an instance is measured under; `is_flips_only`: full prefill, full reuse
        and the planner's preset-measured families (CacheBlend's rank depth 1, the fixed-split
        families), not the other presets: enough for demand curves, not for the simulator's static
        methods."""
        plans = fixed_plans(self.num_layers)
        if is_flips_only:
            planned = (SHALLOW, *fixed_families(self.num_layers))
            plans = [p for p in plans if p.coverage in (0.0, 1.0) or (p.signal.value, p.warmup, p.probe) in planned]
        return plans

    def measure(self, inst: WorkloadInstance, seed: int, is_flips_only: bool = False) -> Outcome:
        subject = instance_subject(self.pipe, inst)
        parts = subject.prompt
        plans = self._verdicts(subject, self.plans(is_flips_only))
        high = plans[preset("full_prefill", 1.0, self.num_layers).label()]
        keys = [(s, d) for s in SIGNALS for d in anchor_depths(self.num_layers)]
        flips = {f"{s}/{d}": Flip(low, high, at) for (s, d), (low, at) in self.profiler.flips(subject, keys, high).items()}
        return Outcome(subject.digest, inst.task, seed, len(parts.prefix_ids),
                       sum(len(c) for c in parts.chunk_ids), len(parts.suffix_ids), inst.max_new_tokens,
                       self.profiler.entropy(subject), plans, flips)


@dataclass
class OutcomeTable:
    model: str
    num_layers: int
    max_positions: int
    outcomes: list[Outcome]

    def passes(self, o: Outcome, signal: str, warmup: int, probe: int, coverage: float) -> bool:
        """The verdict of `o` under (signal, w, p, coverage): a measured fixed plan exactly; a
        planner plan (kv_dev or qci, w, p >= 1) from its flips at the anchor depths, the nearer
        anchor deciding where two disagree; any other static plan from the same (S, w, p) measured
        at the closest coverage at or below (full reuse below all of them)."""
        if warmup >= self.num_layers or coverage >= 1.0 - 1e-9:
            return o.plans[preset("full_prefill", 1.0, self.num_layers).label()]
        if signal in SIGNALS and warmup >= 1 and probe >= 1:
            return self._by_depth(o, signal, warmup + probe, coverage)
        below = [v for c, v in o.static.get((signal, warmup, probe), []) if c <= coverage + 1e-9]
        return below[-1] if below else o.plans[preset("full_reuse", 0.0, self.num_layers).label()]

    def check_measured(self, method: str, outcomes: list[Outcome]) -> None:
        """Raise where `method` is a static preset whose family `outcomes` measured at no coverage
        at or below its own: `passes` would judge it as full reuse, silently (a flips-only table
        measures CacheBlend's family and the fixed-split families only)."""
        served = parse_method(method)
        plan = served.plan(self.num_layers) if served.is_static else None
        if plan is None or not 0 < plan.coverage < 1.0 - 1e-9 or plan.warmup >= self.num_layers:
            return  # CacheSmith plans from flips; full reuse and full prefill are in every table
        family = (plan.signal.value, plan.warmup, plan.probe)
        missing = [o for o in outcomes
                   if not any(0 < c <= plan.coverage + 1e-9 for c, _ in o.static.get(family, []))]
        if missing:
            raise InputError(f"method={method!r}: the outcome table measured {plan.label()}'s family at no "
                             f"coverage in (0, {plan.coverage:g}] for {len(missing)} of {len(outcomes)} "
                             f"instances (e.g. {missing[0].task}/{missing[0].seed}); measure it with "
                             f"`cachesmith outcomes --extend TABLE` or leave the method out")

    @staticmethod
    def _by_depth(o: Outcome, signal: str, depth: int, coverage: float) -> bool:
        anchors = o.anchors[signal]
        lo = max([a for a in anchors if a <= depth], default=anchors[0])
        hi = min([a for a in anchors if a >= depth], default=anchors[-1])
        nearer = lo if depth - lo <= hi - depth else hi  # decides where the two anchors disagree
        return o.flips[f"{signal}/{nearer}"].passes(coverage)

    def by_task(self, task: str) -> list[Outcome]:
        """A task's instances; "mix" is all of them, "pr+vt" those of both tasks."""
        tasks = set(task.split("+"))
        found = self.outcomes if task == "mix" else [o for o in self.outcomes if o.task in tasks]
        missing = tasks - {o.task for o in self.outcomes} - {"mix"}
        if missing or not found:
            raise InputError(f"the outcome table holds no instance of task {task!r}; "
                             f"it has {', '.join(sorted({o.task for o in self.outcomes}))}")
        return found

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"model": self.model, "num_layers": self.num_layers, "max_positions": self.max_positions,
                "outcomes": [asdict(o) for o in self.outcomes]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=None, separators=(",", ":")), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "OutcomeTable":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            outcomes = [Outcome(**{**o, "flips": {k: Flip(**v) for k, v in o["flips"].items()}})
                        for o in data["outcomes"]]
            return cls(data["model"], data["num_layers"], data["max_positions"], outcomes)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"outcome table {path}: cannot be read ({exc})") from exc


def demand(o: Outcome, key: str) -> tuple[float, float]:
    """`o`'s passing interval [from, until) at "signal/depth": from its minimum sufficient coverage
    (0 where full reuse's side passes already, NEVER where nothing does) to where it fails again
    (NEVER where it keeps passing; the flip's coverage where it passes only below it)."""
    flip = o.flips[key]
    return flip_interval(flip.low, flip.high, flip.at)


def preset_demand(o: Outcome, num_layers: int, family: tuple[str, int, int] = SHALLOW) -> tuple[float, float] | None:
    """`o`'s passing interval under `family` (default CacheBlend's (kv_dev, 1, 0)) from its
    measured coverages, as the simulator judges that plan (`OutcomeTable.passes`: the closest
    measured coverage at or below, full reuse's verdict below them all, full prefill's at 100%):
    from the first coverage that passes to the first after it that fails (NEVER where none does).
    Where the verdicts flip more than once, the first passing stretch stands for them. None where
    that family was not measured."""
    points = o.static.get(family)
    if not points:
        return None
    full = o.plans[preset("full_prefill", 1.0, num_layers).label()]
    verdicts = [(0.0, o.plans[preset("full_reuse", 0.0, num_layers).label()])] + points + [(1.0, full)]
    first = next((i for i, (_, v) in enumerate(verdicts) if v), None)
    if first is None:
        return NEVER, NEVER
    end = next((c for c, v in verdicts[first:] if not v), NEVER)
    return verdicts[first][0], end


def demand_curves(table: OutcomeTable) -> tuple[tuple[DemandCurve, ...], float]:
    """(demand curves, entropy threshold) from measured outcomes: per (signal, anchor depth), every
    instance's passing interval (the served mix's curve) and, where the table holds several tasks,
    each task's own; kv_dev at rank depth 1 is CacheBlend's (1, 0), from the instances whose
    presets were measured. The threshold of the `entropy` ablation is fit on the minimum sufficient
    coverages of the same instances. The verdicts read the whole answer, as the serving gate does."""
    if not table.outcomes:
        raise InputError("the outcome table holds no instance to take demand from")
    outs, depths = table.outcomes, anchor_depths(table.num_layers)
    intervals = {(SHALLOW[0], 1): [preset_demand(o, table.num_layers) for o in outs]}  # CacheBlend's (1, 0)
    for family in fixed_families(table.num_layers):  # at rank depth L, where measured
        if any(o.static.get(family) for o in outs):
            intervals[(family[0], table.num_layers)] = [preset_demand(o, table.num_layers, family) for o in outs]
    intervals.update({(s, d): [demand(o, f"{s}/{d}") for o in outs] for s in SIGNALS for d in depths})
    demands = {k: [None if x is None else x[0] for x in v] for k, v in intervals.items()}
    until = {k: [None if x is None else x[1] for x in v] for k, v in intervals.items()}
    mid = depths[len(depths) // 2]
    theta = fit_threshold([o.entropy for o in outs], demands[("kv_dev", mid)], demands[("qci", mid)])
    return task_curves(demands, [o.task for o in outs], until), theta


def is_flips_only(o: Outcome, num_layers: int) -> bool:
    """Whether `o` was measured flips-only (no presets but CacheBlend's)."""
    return preset("epic", DEFAULT_COVERAGES[0], num_layers).label() not in o.plans


def extend_table(pipe: RagPipeline, table: OutcomeTable, cache_path: Path, show_progress: bool = True) -> int:
    """Measure, in place, every fixed plan `table`'s instances lack (the plan list grew since they
    were measured), each instance regenerated from its task and seed and checked against its
    digest; flips-only instances get only what flips-only measures. Resumable through
    `cache_path`. Returns the number of verdicts added."""
    measurer, added = OutcomeMeasurer(pipe, cache_path), 0
    for o in tqdm(table.outcomes, desc="extending outcome tables", unit="inst", disable=not show_progress):
        missing = [p for p in measurer.plans(is_flips_only(o, table.num_layers)) if p.label() not in o.plans]
        if not missing:
            continue
        inst = generate(o.task, o.seed)
        if instance_digest(inst) != o.digest:
            raise InputError(f"outcome table: instance {o.task}/{o.seed} no longer generates the measured "
                             f"instance (digest {o.digest}); measure a new table instead")
        o.plans.update(measurer.verdicts(inst, missing))
        o.__dict__.pop("static", None)  # the cached view of the plans is stale now
        added += len(missing)
    return added


def append_table(pipe: RagPipeline, path: Path, instances: list[tuple[int, WorkloadInstance]], cache_path: Path,
                 show_progress: bool = True) -> int:
    """Measure `(seed, instance)` pairs into the saved table at `path`, skipping instances it
    already holds, saving it after every instance (a stop loses at most the one being measured,
    whose verdicts the cache at `cache_path` keeps). Returns the number of instances added."""
    table = OutcomeTable.load(path)
    if pipe.model.model_dir.name != table.model or pipe.model.num_layers != table.num_layers:
        raise InputError(f"outcome table {path} is of model {table.model} ({table.num_layers} layers), "
                         f"not {pipe.model.model_dir.name} ({pipe.model.num_layers} layers)")
    held = {o.digest for o in table.outcomes}
    todo = [(seed, inst) for seed, inst in instances if instance_digest(inst) not in held]
    measurer = OutcomeMeasurer(pipe, cache_path)
    flips_only = bool(table.outcomes) and all(is_flips_only(o, table.num_layers) for o in table.outcomes)
    for seed, inst in tqdm(todo, desc="outcome tables", unit="inst", disable=not show_progress):
        table.outcomes.append(measurer.measure(inst, seed, flips_only))
        table.save(path)
    return len(todo)


def default_table_path(pipe: RagPipeline) -> Path:
    """Where `cachesmith outcomes` keeps this model's table (its verdict cache sits beside it)."""
    dtype = str(pipe.model.dtype).removeprefix("torch.")
    return cachesmith_home() / "outcomes" / f"{pipe.model.model_dir.name}-{dtype}-{pipe.model.device.type}.json"


def measure_table(pipe: RagPipeline, instances: list[tuple[int, WorkloadInstance]], cache_path: Path,
                  show_progress: bool = True, is_flips_only: bool = False) -> OutcomeTable:
    """The table of `(seed, instance)` pairs; resumes from `cache_path`'s verdicts."""
    measurer = OutcomeMeasurer(pipe, cache_path)
    outcomes = [measurer.measure(inst, seed, is_flips_only) for seed, inst in
                tqdm(instances, desc="outcome tables", unit="inst", disable=not show_progress)]
    return OutcomeTable(pipe.model.model_dir.name, pipe.model.num_layers, pipe.model.config.max_positions, outcomes)
