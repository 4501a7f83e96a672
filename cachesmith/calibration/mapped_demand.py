"""Demand distributions taken from a profile of another model, mapped onto the served model's depth.

In: a profile file (any format version) and the served model's number of layers. Out: its demand
curves with every rank depth moved to where the served model would have measured it, and its
entropy threshold as is. A model nobody profiled serves with the packaged SmolLM2 profile's demand
(`REFERENCE_PROFILE`) this way, until `cachesmith profile` measures its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from cachesmith.planner.profile import DemandCurve, ProfileError

# the packaged model's profile: the demand a model without a profile of its own borrows
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "data"  # the profiles shipped with the package
REFERENCE_PROFILE = PACKAGED_DIR / "smollm2-135m-float32-cpu.json"
MIN_ANCHOR_DEPTH = 2  # a (w, p) split needs w >= 1 WarmUp and p >= 1 probe layers (`demand.anchor_depths`)


def mapped_depth(depth: int, from_layers: int, to_layers: int) -> int:
    """Where rank depth `depth` of a `from_layers`-layer model lands in a `to_layers`-layer one.

    Demand follows relative depth (how much of the model has run when tokens are ranked), so an
    anchor depth moves proportionally, as `demand.anchor_depths` places anchors at fractions of the
    layers: round(depth * to / from), at least 2. Two depths are layer positions, not fractions,
    and map exactly: 1 (KV deviation's (1, 0), CacheBlend's family, which the planner searches only
    where the demand has a depth-1 curve) and the last layer (the fixed (1, L - 1) families).
    Never beyond `to_layers`."""
    if from_layers < 1 or to_layers < 1:
        raise ProfileError(f"layers must be >= 1 to map demand depths (from {from_layers} to {to_layers})")
    if depth <= 1:
        return 1
    if depth >= from_layers:
        return to_layers
    return min(to_layers, max(MIN_ANCHOR_DEPTH, round(depth * to_layers / from_layers)))


def map_demand_depths(curves: tuple[DemandCurve, ...], from_layers: int,
                      to_layers: int) -> tuple[DemandCurve, ...]:
    """`curves` with each rank depth `mapped_depth`'s. Where two curves of one (task, signal) land
    on the same depth, the one measured closest to that relative depth stays (an exactly mapped
    depth, 1 or the last layer, before any), so no (task, signal, depth) repeats; the order of the
    kept curves is theirs in `curves`."""
    kept: dict[tuple[str | None, str, int], tuple[tuple[bool, float], int]] = {}
    for i, curve in enumerate(curves):
        depth = mapped_depth(curve.rank_depth, from_layers, to_layers)
        is_exact = curve.rank_depth <= 1 or curve.rank_depth >= from_layers
        rank = (not is_exact, abs(curve.rank_depth / from_layers - depth / to_layers))
        key = (curve.task, curve.signal, depth)
        if key not in kept or rank < kept[key][0]:
            kept[key] = (rank, i)
    chosen = sorted((i, key[2]) for key, (_, i) in kept.items())
    return tuple(replace(curves[i], rank_depth=depth) for i, depth in chosen)


@dataclass(frozen=True)
class DemandSource:
    """Demand read from a profile file of any format version (demand depends on the model, not on
    how costs were measured), with the depth and model it was measured on."""
    path: Path
    model_name: str
    num_layers: int
    curves: tuple[DemandCurve, ...]
    entropy_threshold: float
    model_fingerprint: str | None = None

    def onto(self, num_layers: int) -> tuple[tuple[DemandCurve, ...], float]:
        """(curves mapped onto a `num_layers`-layer model, entropy threshold)."""
        return map_demand_depths(self.curves, self.num_layers, num_layers), self.entropy_threshold

    def describe(self, num_layers: int) -> str:
        if num_layers == self.num_layers:
            return f"the {self.model_name} profile's ({self.path})"
        return (f"the {self.model_name} profile's ({self.path}), mapped from its {self.num_layers} layers "
                f"onto this model's {num_layers} layers")


def read_demand_source(path: Path) -> DemandSource:
    """The demand of the profile at `path`; a ProfileError naming the file and the fault."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        curves = tuple(DemandCurve.from_json(d) for d in data["demand"])
        return DemandSource(Path(path), str(data.get("model_name", Path(path).stem)), int(data["num_layers"]),
                            curves, float(data["entropy_threshold"]), data.get("model_fingerprint"))
    except (OSError, UnicodeDecodeError, AttributeError, ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"profile {path}: no readable demand distributions ({type(exc).__name__}: {exc}); "
                           f"give a profile file with demand, num_layers and entropy_threshold") from exc


__all__ = ["PACKAGED_DIR", "REFERENCE_PROFILE", "DemandSource", "map_demand_depths", "mapped_depth", "read_demand_source"]
