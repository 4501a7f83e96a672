"""The profile file: what the planner knows about one (model, dtype, device), measured offline.

In: measurements from `cachesmith.profiler`. Out: a versioned JSON file with the compute cost
coefficients per layer kind and of the per-batch overhead (each with a per-request term: format 2),
KV bytes per token per layer, each store tier's read bandwidth, the demand distributions (minimum
sufficient coverage per signal and rank depth) and the fit error.
Loading checks the format version, model fingerprint, dtype and device: a profile from elsewhere
raises `ProfileError` naming the mismatch, never a silently wrong plan.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from cachesmith.errors import InputError

PROFILE_FORMAT = 2  # 2: per-request terms, a "select" cost; costs measured through the staged serving path
PASS_KINDS = ("full", "qci_probe", "query_only", "score_patch", "patch")  # the runner's layer passes
LAYER_KINDS = PASS_KINDS + ("select",)  # and the selection between passes (cost_model.Step.selects)
NEVER = math.inf  # demand of a request that no coverage makes pass


class ProfileError(InputError):
    """A profile file is missing, malformed, of another format version, model, dtype or device."""


@dataclass(frozen=True)
class PhaseCost:
    """seconds = intercept + per_row * rows + per_pair * pairs + per_aux * aux_rows + per_request *
    requests: the features of `cost_model.step_features` (a layer pass) and `overhead_features`."""
    intercept_s: float
    per_row_s: float
    per_pair_s: float
    per_aux_s: float = 0.0
    per_request_s: float = 0.0

    def coefficients(self) -> tuple[float, float, float, float, float]:
        return self.intercept_s, self.per_row_s, self.per_pair_s, self.per_aux_s, self.per_request_s

    def scaled(self, factor: float) -> "PhaseCost":
        return PhaseCost(*(c * factor for c in self.coefficients()))


@dataclass(frozen=True)
class DemandCurve:
    """The coverages at which each profiling request passes its gate, over the served mix (`task`
    None) or over one task's requests (read when a request names its task), as one interval per
    request: from its minimum sufficient coverage `demands[i]` (NEVER: none passes) up to
    `until[i]`, where it fails again (NEVER, or `until` None for every request: it keeps passing).
    A request that full prefill fails may still pass at low coverage, where the isolated chunks'
    cached KV answers it and the fully restored context does not: demand 0, a finite `until`."""
    signal: str
    rank_depth: int
    demands: tuple[float, ...]
    task: str | None = None
    until: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.until is not None and len(self.until) != len(self.demands):
            raise ProfileError(f"demand curve {self.signal}@{self.rank_depth}: {len(self.until)} `until` "
                               f"values for {len(self.demands)} requests")

    def pass_rate(self, coverages) -> np.ndarray:
        """Fraction of the requests passing at each of `coverages` [G]."""
        c = np.asarray(coverages, float)[:, None] + 1e-9
        ok = np.asarray(self.demands, float)[None, :] <= c
        if self.until is not None:
            ok &= c < np.asarray(self.until, float)[None, :]
        return ok.mean(1)

    def to_json(self) -> dict:
        finite = lambda xs: [None if math.isinf(x) else x for x in xs]  # noqa: E731
        out = {"signal": self.signal, "rank_depth": self.rank_depth, "demands": finite(self.demands),
               "task": self.task}
        if self.until is not None:
            out["until"] = finite(self.until)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "DemandCurve":
        read = lambda xs: tuple(NEVER if x is None else float(x) for x in xs)  # noqa: E731
        until = d.get("until")
        return cls(d["signal"], int(d["rank_depth"]), read(d["demands"]), d.get("task"),
                   None if until is None else read(until))


@dataclass(frozen=True)
class Profile:
    model_fingerprint: str
    model_name: str
    dtype: str
    device: str
    num_layers: int
    kv_bytes_per_token_layer: int  # K + V of one token in one layer
    layer_costs: dict[str, PhaseCost]
    # per batch outside the layer passes (staging, assembling, the first token, waits the link walk
    # does not predict): intercept + per_row * all tokens + per_request * requests
    overhead: PhaseCost
    tier_gbps: dict[str, float] = field(default_factory=dict)
    demand: tuple[DemandCurve, ...] = ()
    entropy_threshold: float = 0.5  # H > theta routes a request to kv_dev
    fit_error: dict[str, float] = field(default_factory=dict)
    format_version: int = PROFILE_FORMAT

    def __post_init__(self) -> None:
        missing = [k for k in LAYER_KINDS if k not in self.layer_costs]
        if missing:
            raise ProfileError(f"profile lacks layer costs for {', '.join(missing)}")

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["demand"] = [c.to_json() for c in self.demand]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, model_fingerprint: str | None = None, dtype: str | None = None,
             device: str | None = None) -> "Profile":
        path = Path(path)
        data = _read(path)
        _check_fields(path, data)
        try:
            profile = cls(**{**data, "layer_costs": {k: PhaseCost(**v) for k, v in data["layer_costs"].items()},
                             "overhead": PhaseCost(**data["overhead"]),
                             "demand": tuple(DemandCurve.from_json(d) for d in data["demand"])})
        except ProfileError as exc:
            raise ProfileError(f"profile {path}: {exc}") from exc
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"profile {path}: malformed ({type(exc).__name__}: {exc})") from exc
        for name, want, have in (("model", model_fingerprint, profile.model_fingerprint),
                                 ("dtype", dtype, profile.dtype), ("device", device, profile.device)):
            if want is not None and want != have:
                raise ProfileError(f"profile {path} was measured for {name} {have!r}, not {want!r}; "
                                   f"run `cachesmith profile` for this {name}")
        return profile


def _read(path: Path) -> dict:
    """The JSON object in `path`, of this format version."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {path}: cannot be read ({exc})") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"profile {path}: not valid JSON, truncated or corrupt ({exc})") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path}: holds a JSON {type(data).__name__}, not an object")
    if data.get("format_version") != PROFILE_FORMAT:
        raise ProfileError(f"profile {path}: format_version {data.get('format_version')!r}, this cachesmith "
                           f"reads {PROFILE_FORMAT}; run `cachesmith profile` again")
    return data


def _check_fields(path: Path, data: dict) -> None:
    """Every field without a default present, and no field this version does not know."""
    known = {f.name: f for f in fields(Profile)}
    missing = [n for n, f in known.items() if n not in data and f.default is MISSING and f.default_factory is MISSING]
    unknown = sorted(set(data) - set(known))
    if missing:
        raise ProfileError(f"profile {path}: missing field(s) {', '.join(missing)}; run `cachesmith profile` again")
    if unknown:
        raise ProfileError(f"profile {path}: unknown field(s) {', '.join(unknown)}; run `cachesmith profile` again")
