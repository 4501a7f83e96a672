"""What a planner is asked and what it answers: its configuration, a request as the planner sees
it, and the batch plan it returns.

In: the caller's settings (`PlannerConfig`: budget band, searched depths and splits, the signal
rule, the task hint, mix learning, pace margin) and each request's token counts, QCI entropy and
task (`PlanRequest`). Out: a `BatchPlan`: signal S, split (w, p), per-request coverages, the
predicted TTFT, expected passes and the band it was planned in. Validation raises `ConfigError`.
"""
from __future__ import annotations

from dataclasses import dataclass

from cachesmith.errors import ConfigError
from cachesmith.recompute import RecomputeConfig

# the signals the planner searches; ties between their plans go to the first. qci_last is
# FusionRAG's ranking after WarmUp layer 0: one family (1, L - 1) (`recompute.FIXED_FAMILIES`),
# planned where the profile holds its demand. fused (that ranking interleaved with KV deviation's)
# is planned only when fixed (`PlannerConfig.signal`): searched by default it lost grid wins
# against the old costs and, against the refit ones, won them but lost replays of fresh instances
# on the real model (ADR 0020, docs/adr/0020-signal-choice.md)
SIGNALS = ("kv_dev", "qci", "qci_last")
FIXABLE_SIGNALS = (*SIGNALS, "fused")
SIGNAL_RULES = ("robust", "passes", "entropy")


@dataclass(frozen=True)
class PlannerConfig:
    r_min: float = 0.05  # budget floor: TTFT of (S, 1, 1, r_min)
    r_max: float = 0.50  # saturation: TTFT of (S, 1, 1, r_max)
    max_rank_fraction: float = 0.5  # deepest rank depth considered, as a fraction of the layers
    num_splits: int = 4  # (w, p) splits tried per rank depth
    entropy_threshold: float | None = None  # None: the profile's
    bandwidth_gbps: float | None = None  # None: the profile's fastest tier (the monitor updates it)
    signal: str | None = None  # fix the selection signal (ablation); None: chosen per batch by signal_rule
    # "robust": KV deviation unless another signal expects more passes under every demand the
    # profile knows by signal_margin_z standard errors (`signal_choice`); "passes": the most
    # expected passes under the batch's demand; "entropy": the paper's threshold (ablations)
    signal_rule: str = "robust"
    signal_margin_z: float = 1.0
    use_task_hint: bool = True  # a batch whose requests all name one task plans with that task's demand
    is_mix_learned: bool = False  # price hint-free batches with the served mix learned from verdicts
    # plans are sized to end inside the budget at the pace this many spreads of the pace book's
    # recent price errors above the mean, up to max_pace_margin x. 0 (at the mean) by default: on a
    # simulated swinging machine no z > 0 met more SLOs, the monitor absorbs slow batches already
    # (ADR 0022, docs/adr/0022-pace-book.md)
    pace_margin_z: float = 0.0
    max_pace_margin: float = 1.5

    def __post_init__(self) -> None:
        if self.signal not in (None, *FIXABLE_SIGNALS):
            raise ConfigError(f"signal={self.signal!r}: must be one of {', '.join(FIXABLE_SIGNALS)} or None "
                              f"(chosen per batch)")
        if self.signal_rule not in SIGNAL_RULES:
            raise ConfigError(f"signal_rule={self.signal_rule!r}: must be one of {', '.join(SIGNAL_RULES)}")
        if not 0 < self.r_min < self.r_max <= 1:
            raise ConfigError(f"need 0 < r_min ({self.r_min}) < r_max ({self.r_max}) <= 1")
        if not 0 < self.max_rank_fraction <= 1:
            raise ConfigError(f"max_rank_fraction={self.max_rank_fraction} must be in (0, 1]")
        if self.num_splits < 1:
            raise ConfigError(f"num_splits={self.num_splits} must be >= 1")
        if not 0 <= self.signal_margin_z <= 4:
            raise ConfigError(f"signal_margin_z={self.signal_margin_z} must be in [0, 4]")
        if not 0 <= self.pace_margin_z <= 4:
            raise ConfigError(f"pace_margin_z={self.pace_margin_z} must be in [0, 4]")
        if not 1 <= self.max_pace_margin <= 4:
            raise ConfigError(f"max_pace_margin={self.max_pace_margin} must be in [1, 4]")


@dataclass(frozen=True)
class PlanRequest:
    context_tokens: int
    suffix_tokens: int
    prefix_tokens: int = 0
    qci_entropy: float | None = None  # normalized entropy of layer-0 QCI scores, in [0, 1]
    task: str | None = None  # the task the request names (a hint), if any


@dataclass(frozen=True)
class BatchPlan:
    signal: str
    warmup: int
    probe: int
    coverages: tuple[float, ...]
    predicted_ttft_s: float
    expected_passes: float
    budget_s: float
    floor_s: float
    saturation_s: float
    status: str  # "planned", "below_floor" or "above_saturation" (static plan)
    decision_s: float = 0.0
    task: str | None = None  # whose demand priced the plan (None: the served mix's)

    @property
    def rank_depth(self) -> int:
        return self.warmup + self.probe

    def recompute_config(self) -> RecomputeConfig:
        """The batch's shared (S, w, p); each request's own coverage goes on its request."""
        return RecomputeConfig(self.signal, self.warmup, self.probe, max(self.coverages))
