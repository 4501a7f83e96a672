"""The `(S, w, p, r)` recompute plan and the named baseline presets.

In: a signal name, warm-up depth, probe length and default coverage. Out: a validated, frozen
`RecomputeConfig`; `validate_for(num_layers)` checks the depth against a concrete model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from cachesmith.errors import ConfigError


class Signal(str, Enum):
    KV_DEV = "kv_dev"
    QCI = "qci"
    QCI_LAST = "qci_last"
    FUSED = "fused"  # KV deviation at layer w and the last layer's query attention, ranks fused
    POSITION = "position"


KV_DEV_TARGETS = ("k", "v", "kv")


@dataclass(frozen=True)
class RecomputeConfig:
    signal: Signal
    warmup: int
    probe: int
    coverage: float
    kv_dev_target: str = "v"  # measured best of k / v / kv on the multi-needle task (ADR 0014, docs/adr/0014-recompute-semantics.md)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "signal", Signal(self.signal))
        except ValueError:
            raise ConfigError(f"signal={self.signal!r} is not one of {[s.value for s in Signal]}") from None
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"warmup={self.warmup!r} must be an integer >= 0")
        if not isinstance(self.probe, int) or self.probe < 0:
            raise ConfigError(f"probe={self.probe!r} must be an integer >= 0")
        check_coverage(self.coverage, "coverage")
        if self.signal is Signal.POSITION and self.probe:
            raise ConfigError(f"probe={self.probe} must be 0 for signal 'position' (it needs no probe)")
        if self.signal is Signal.FUSED and self.warmup < 1:
            raise ConfigError(f"warmup={self.warmup} must be >= 1 for signal 'fused' (its KV deviation "
                              f"at layer 0 would compare each token's K/V with itself)")
        if self.kv_dev_target not in KV_DEV_TARGETS:
            raise ConfigError(f"kv_dev_target={self.kv_dev_target!r} is not one of {KV_DEV_TARGETS}")

    def validate_for(self, num_layers: int) -> None:
        if self.warmup + self.probe > num_layers:
            raise ConfigError(f"warmup + probe = {self.warmup + self.probe} exceeds the model's "
                              f"{num_layers} layers")

    def is_full_prefill(self, num_layers: int) -> bool:
        return self.warmup >= num_layers

    @property
    def patch_start(self) -> int:
        """The first Patch layer: KV deviation's probe layers are full layers, the other signals'
        probes rewind to w."""
        return self.warmup + (self.probe if self.signal is Signal.KV_DEV else 0)

    def has_patch(self, num_layers: int) -> bool:
        """Whether any layer is left for Patch."""
        return self.patch_start < num_layers

    def label(self) -> str:
        return f"({self.signal.value},{self.warmup},{self.probe},{self.coverage:.0%})"


def parse_label(label: str) -> tuple[str, int, int, float]:
    """(signal, w, p, coverage) of a plan label as `RecomputeConfig.label` writes it, e.g.
    "(kv_dev,1,1,30%)" (run records and outcome tables keep plans so)."""
    signal, w, p, coverage = label.strip("()").split(",")
    return signal, int(w), int(p), float(coverage.rstrip("%")) / 100


def check_coverage(coverage: float, field: str) -> float:
    if not isinstance(coverage, (int, float)) or math.isnan(coverage) or not 0.0 <= coverage <= 1.0:
        raise ConfigError(f"{field}={coverage!r} must be a fraction in [0, 1]")
    return float(coverage)


def full_prefill(num_layers: int) -> RecomputeConfig:
    return RecomputeConfig(Signal.POSITION, num_layers, 0, 1.0)


def full_reuse() -> RecomputeConfig:
    return RecomputeConfig(Signal.POSITION, 0, 0, 0.0)


def cacheblend(coverage: float) -> RecomputeConfig:
    return RecomputeConfig(Signal.KV_DEV, 1, 0, coverage)


def epic(coverage: float) -> RecomputeConfig:
    return RecomputeConfig(Signal.POSITION, 0, 0, coverage)


def prophetkv(coverage: float, num_layers: int) -> RecomputeConfig:
    return RecomputeConfig(Signal.QCI, 0, num_layers, coverage)


def fusionrag(coverage: float, num_layers: int) -> RecomputeConfig:
    return RecomputeConfig(Signal.QCI_LAST, 0, num_layers, coverage)


def last_layer(coverage: float, num_layers: int) -> RecomputeConfig:
    """FusionRAG's ranking as a plan decided after WarmUp layer 0: layer 0 exact, the query alone
    through layers 1..L-1, scored by the last layer (its probe always runs to the last layer, so
    its rank depth is L). The planner's last-layer family."""
    return RecomputeConfig(Signal.QCI_LAST, 1, num_layers - 1, coverage)


def fused_family(coverage: float, num_layers: int) -> RecomputeConfig:
    """Both rankings at once, decided after WarmUp layer 0: the query alone through layers
    1..L-1 scores by the last layer (as `last_layer`), layer 1's KV deviation scores as
    CacheBlend's, and the two rankings are fused (`signals.fuse`)."""
    return RecomputeConfig(Signal.FUSED, 1, num_layers - 1, coverage)


# signals whose planner family is one fixed split decided after WarmUp layer 0 (their probes run to
# the last layer, so their rank depth is L): signal -> its plan at (coverage, num_layers)
FIXED_FAMILIES = {Signal.QCI_LAST.value: last_layer, Signal.FUSED.value: fused_family}


def fixed_splits(num_layers: int) -> dict[str, tuple[int, int]]:
    """signal -> (w, p) of each fixed-split family on a model of `num_layers`."""
    plans = {s: make(0.0, num_layers) for s, make in FIXED_FAMILIES.items()}
    return {s: (c.warmup, c.probe) for s, c in plans.items()}


PRESET_NAMES = ("full_prefill", "full_reuse", "cacheblend", "epic", "prophetkv", "fusionrag")


def preset(name: str, coverage: float, num_layers: int) -> RecomputeConfig:
    """A named baseline at `coverage` (ignored by full_prefill / full_reuse)."""
    makers = {
        "full_prefill": lambda: full_prefill(num_layers),
        "full_reuse": full_reuse,
        "cacheblend": lambda: cacheblend(coverage),
        "epic": lambda: epic(coverage),
        "prophetkv": lambda: prophetkv(coverage, num_layers),
        "fusionrag": lambda: fusionrag(coverage, num_layers),
    }
    if name not in makers:
        raise ConfigError(f"preset={name!r} is not one of {list(PRESET_NAMES)}")
    return makers[name]()
