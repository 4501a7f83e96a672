"""The profile file: what the planner knows about one (model, dtype, device), measured offline.

In: measurements from `cachesmith.profiler`. Out: a versioned JSON file with the compute cost
coefficients per layer kind, KV bytes per token per layer, each store tier's read bandwidth, the
demand distributions (minimum sufficient coverage per signal and rank depth) and the fit error.
Loading checks the format version, model fingerprint, dtype and device: a profile from elsewhere
raises `ProfileError` naming the mismatch, never a silently wrong plan.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cachesmith.errors import InputError

PROFILE_FORMAT = 1
LAYER_KINDS = ("full", "qci_probe", "query_only", "score_patch", "patch")
NEVER = math.inf  # demand of a request that no coverage makes pass


class ProfileError(InputError):
    """A profile file is missing, malformed, of another format version, model, dtype or device."""


@dataclass(frozen=True)
class PhaseCost:
    """seconds = intercept + per_row * rows + per_pair * pairs + per_aux * aux_rows (see cost_model)."""
    intercept_s: float
    per_row_s: float
    per_pair_s: float
    per_aux_s: float = 0.0


@dataclass(frozen=True)
class DemandCurve:
    """Minimum sufficient coverage of each profiling request (NEVER: fails even at 100%)."""
    signal: str
    rank_depth: int
    demands: tuple[float, ...]


@dataclass(frozen=True)
class Profile:
    model_fingerprint: str
    model_name: str
    dtype: str
    device: str
    num_layers: int
    kv_bytes_per_token_layer: int  # K + V of one token in one layer
    layer_costs: dict[str, PhaseCost]
    overhead: PhaseCost  # per batch outside the layer loop: intercept + per_row * all tokens
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
        data["demand"] = [{**d, "demands": [None if math.isinf(x) else x for x in d["demands"]]}
                          for d in data["demand"]]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, model_fingerprint: str | None = None, dtype: str | None = None,
             device: str | None = None) -> "Profile":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ProfileError(f"profile {path}: cannot be read ({exc})") from exc
        if not isinstance(data, dict) or data.get("format_version") != PROFILE_FORMAT:
            found = data.get("format_version") if isinstance(data, dict) else None
            raise ProfileError(f"profile {path}: format_version {found!r}, this cachesmith reads "
                               f"{PROFILE_FORMAT}; run `cachesmith profile` again")
        try:
            profile = cls(**{**data, "layer_costs": {k: PhaseCost(**v) for k, v in data["layer_costs"].items()},
                             "overhead": PhaseCost(**data["overhead"]),
                             "demand": tuple(DemandCurve(d["signal"], d["rank_depth"], tuple(
                                 NEVER if x is None else float(x) for x in d["demands"])) for d in data["demand"])})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"profile {path}: malformed ({exc})") from exc
        for name, want, have in (("model", model_fingerprint, profile.model_fingerprint),
                                 ("dtype", dtype, profile.dtype), ("device", device, profile.device)):
            if want is not None and want != have:
                raise ProfileError(f"profile {path} was measured for {name} {have!r}, not {want!r}; "
                                   f"run `cachesmith profile` for this {name}")
        return profile
