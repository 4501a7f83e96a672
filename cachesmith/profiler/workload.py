"""`cachesmith profile --workload FILE.jsonl`: the demand of the user's own requests.

In: a `RagPipeline`, a workload file (docs/workloads.md, "Workload files"; gold optional) and a gate: `fidelity`
(an answer passes when its canonical form equals full prefill's: no labels needed) or `task` (the
gold). Out: `<profile stem>.workload.json` beside the profile (demand curves over the file's
requests as the served mix, and per task where the file names several; the entropy threshold; the
file's digest, the gate and the time it took), which `find_profile` lays over the costs of whatever
profile serves (measured or packaged): costs depend on the machine, demand on the model and the
workload. Every verdict is appended to `<stem>.workload.verdicts.jsonl`, so a stopped run resumes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cachesmith.errors import InputError
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.planner import SIGNALS as PLANNED_SIGNALS
from cachesmith.planner.planner import PlannerConfig
from cachesmith.planner.profile import DemandCurve, Profile, ProfileError
from cachesmith.profiler.demand import DemandProfiler
from cachesmith.recompute import FIXED_FAMILIES
from cachesmith.instance import WorkloadInstance, load_workload_file

WORKLOAD_FORMAT = 1
# the planner plans by demand up to its saturation coverage; above it, the most the budget fits
DEFAULT_MAX_COVERAGE = PlannerConfig().r_max
# the fixed-split families the planner plans by default (qci_last); fused is planned only as an
# ablation and keeps the profile's own curve (`WorkloadDemand.applied`)
PLANNED_FAMILIES = tuple(s for s in PLANNED_SIGNALS if s in FIXED_FAMILIES)
log = logging.getLogger(__name__)


def workload_path(profile_path: Path) -> Path:
    return profile_path.with_name(profile_path.stem + ".workload.json")


def read_workload(path: Path, num_requests: int | None = None) -> tuple[list[WorkloadInstance], str]:
    """(the first `num_requests` requests of a workload file, the file's sha256). A line that
    cannot be read stops the profile, naming it: a demand curve must not drop requests silently."""
    lines = load_workload_file(str(path))
    bad = [line for line in lines if isinstance(line, str)]
    if bad:
        raise InputError(f"{len(bad)} line(s) of {path} cannot be profiled; first: {bad[0]}")
    if num_requests is not None:
        if num_requests < 1:
            raise InputError(f"num_requests={num_requests} must be >= 1")
        lines = lines[:num_requests]
    return lines, hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def default_gate(instances: list[WorkloadInstance]) -> str:
    """The task gate where every request brings gold, else fidelity (no labels needed)."""
    return "task" if all(inst.gold for inst in instances) else "fidelity"


@dataclass(frozen=True)
class WorkloadDemand:
    model_fingerprint: str
    dtype: str
    workload: str  # the file's name and sha256
    gate: str
    num_requests: int
    demand: tuple[DemandCurve, ...]
    entropy_threshold: float
    seconds: float  # wall time of the measurement that completed it
    max_coverage: float = 1.0  # flips above it were recorded at 1.0 (`flip_search`)
    format_version: int = WORKLOAD_FORMAT

    def save(self, path: Path) -> None:
        data = {**self.__dict__, "demand": [c.to_json() for c in self.demand]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "WorkloadDemand":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format_version") != WORKLOAD_FORMAT:
                raise ProfileError(f"format_version {data.get('format_version')!r}, this cachesmith reads "
                                   f"{WORKLOAD_FORMAT}")
            return cls(**{**data, "demand": tuple(DemandCurve.from_json(c) for c in data["demand"])})
        except ProfileError as exc:
            raise ProfileError(f"workload demand {path}: {exc}") from exc
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ProfileError(f"workload demand {path}: unreadable ({type(exc).__name__}: {exc})") from exc

    def applied(self, profile: Profile) -> Profile:
        """`profile` priced with this workload's demand; a signal the workload was not profiled for
        (an ablation's) keeps the profile's served-mix curves."""
        measured = {c.signal for c in self.demand}
        kept = tuple(c for c in profile.demand if c.signal not in measured and c.task is None)
        return replace(profile, demand=self.demand + kept, entropy_threshold=self.entropy_threshold)


def run_workload_demand(pipe: RagPipeline, workload: Path, out: Path, gate: str | None = None,
                        num_requests: int | None = None, show_progress: bool = True,
                        max_coverage: float | None = None) -> WorkloadDemand:
    """Measure the demand of the workload file's requests and save it at `out`. Flips above
    `max_coverage` (default: the planner's saturation coverage) are not searched for."""
    max_coverage = DEFAULT_MAX_COVERAGE if max_coverage is None else max_coverage
    instances, digest = read_workload(workload, num_requests)
    gate = gate or default_gate(instances)
    if gate == "task" and not all(inst.gold for inst in instances):
        raise InputError(f"{workload}: some requests have no gold answer, which the task gate needs; "
                         f"use the fidelity gate (--gate fidelity)")
    out.parent.mkdir(parents=True, exist_ok=True)
    profiler = DemandProfiler(pipe, out.with_name(out.stem + ".verdicts.jsonl"), gate=gate,
                              max_coverage=max_coverage)
    start = time.perf_counter()
    curves, theta, _ = profiler.run(instances, show_progress=show_progress, fixed_families=PLANNED_FAMILIES)
    demand = WorkloadDemand(pipe.model.fingerprint, str(pipe.model.dtype).removeprefix("torch."),
                            f"{Path(workload).name} sha256:{digest}", gate, len(instances), curves, theta,
                            time.perf_counter() - start, max_coverage)
    demand.save(out)
    return demand


def workload_keys(profiler: DemandProfiler) -> list[tuple[str, int]]:
    """The (signal, rank depth) searches of a workload's demand: what the planner prices."""
    return profiler.keys(fixed_families=PLANNED_FAMILIES)


def load_workload_demand(path: Path, fingerprint: str, dtype: str) -> WorkloadDemand:
    """A workload demand file named explicitly: it must be readable and this model's."""
    demand = WorkloadDemand.load(path)
    if (demand.model_fingerprint, demand.dtype) != (fingerprint, dtype):
        raise ProfileError(f"workload demand {path} was measured for model {demand.model_fingerprint} "
                           f"({demand.dtype}), not {fingerprint} ({dtype})")
    return demand


def with_workload_demand(profile: Profile, profile_path: Path, fingerprint: str, dtype: str) -> Profile:
    """`profile` with the demand `cachesmith profile --workload` measured for this model and dtype,
    where there is one; a file for another model or dtype, or an unreadable one, is named in a
    warning and left aside."""
    path = workload_path(profile_path)
    if not path.exists():
        return profile
    try:
        demand = load_workload_demand(path, fingerprint, dtype)
    except ProfileError as exc:
        log.warning("%s; serving with the profile's own demand", exc)
        return profile
    log.info("demand of workload %s (%d requests, %s gate) from %s", demand.workload, demand.num_requests,
             demand.gate, path)
    return demand.applied(profile)
