"""The demand of a user's own requests, as `cachesmith profile --workload` saved it, laid over the
profile that serves.

In: `<profile stem>.workload.json` beside the profile (demand curves over a workload file's
requests as the served mix, and per task where the file names several; the entropy threshold; the
file's digest, the gate and the time it took) or a file named explicitly. Out: a `WorkloadDemand`
and the profile priced with it (`with_workload_demand`): costs depend on the machine, demand on the
model and the workload. The measuring is `profiler.workload`'s; a serving engine's idle-time work
searches the same keys (`workload_keys`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from cachesmith.planner.planner import SIGNALS as PLANNED_SIGNALS
from cachesmith.planner.planner import PlannerConfig
from cachesmith.planner.profile import DemandCurve, Profile, ProfileError
from cachesmith.calibration.demand import DemandProfiler
from cachesmith.recompute import FIXED_FAMILIES

WORKLOAD_FORMAT = 1
# the planner plans by demand up to its saturation coverage; above it, the most the budget fits
DEFAULT_MAX_COVERAGE = PlannerConfig().r_max
# the fixed-split families the planner plans by default (qci_last); fused is planned only as an
# ablation and keeps the profile's own curve (`WorkloadDemand.applied`)
PLANNED_FAMILIES = tuple(s for s in PLANNED_SIGNALS if s in FIXED_FAMILIES)
log = logging.getLogger(__name__)


def workload_path(profile_path: Path) -> Path:
    return profile_path.with_name(profile_path.stem + ".workload.json")


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
