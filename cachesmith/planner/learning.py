"""What the planner learns while serving, and what it prices with because of it.

In: executed batches' measured / predicted pace (`observe`), served requests' quality verdicts
(`observe_verdict`), shadow samples (`observe_sample`) and the runtime monitor's link bandwidth
(`set_bandwidth`). Out: the pace a kind of batch is priced at (`pace`, `pace_in_class`), how much
slower than that plans are sized for (`margin`), and, for hint-free batches while learning, the
learned demand that replaces the profiled mix's (`mix_for`). `Planner` mixes this in; its state
is the pace book, the served mix and the learned demand (`_init_learning`).
"""
from __future__ import annotations

import math
from dataclasses import replace

from cachesmith.planner.cost_model import CostModel
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.learned_demand import LearnedDemand
from cachesmith.planner.pace import PaceBook
from cachesmith.planner.served_mix import ServedMix


class OnlineLearning:
    """The learning half of `Planner`: it expects `config` and `cost` on the planner."""

    def _init_learning(self, demand: DemandModel) -> None:
        # hint-free batches' demand, learned from served requests' verdicts (`observe_verdict`)
        self.served_mix = ServedMix(demand) if self.config.is_mix_learned else None
        # the served workload's own curves, from shadow samples and verdicts (`observe_sample`)
        self.learned = LearnedDemand(demand) if self.config.is_mix_learned else None
        # measured / predicted TTFT per kind of batch, learned from executed batches (`observe`):
        # the offline cost fit is biased per signal, plan family and batch size (planner/pace.py)
        self.paces = PaceBook()

    def observe(self, signal: str, pace: float, probe: int = 1, num_tokens: int | None = None) -> None:
        """A batch of `signal` (probing `probe` layers, `num_tokens` prompt tokens) ran at `pace` x
        the uncorrected cost model's time: every level of the pace book learns it."""
        self.paces.observe(signal, pace, probe, num_tokens)

    def observe_verdict(self, signal: str, warmup: int, probe: int, coverage: float, passed: bool) -> None:
        """A served request's quality verdict under the (S, w, p) it ran and the coverage it ended
        with: the learned served mix (if any) takes it in."""
        if self.served_mix is not None:
            self.served_mix.observe(signal, warmup + probe, coverage, passed)
            self.learned.observe_verdict(signal, warmup + probe, coverage, passed)

    def observe_sample(self, intervals: dict[tuple[str, int], tuple[float, float]]) -> None:
        """A shadow sample: one served request's passing interval per (signal, anchor depth)."""
        if self.learned is not None:
            self.learned.observe_sample(intervals)

    def pace(self, signal: str, probe: int = 1, num_tokens: int | None = None) -> float:
        """The learned measured / predicted factor for this kind of batch (1.0 before any)."""
        return self.paces.pace(signal, probe, num_tokens)

    def pace_in_class(self, signal: str, probe: int, size: int | None) -> float:
        """`pace` for a batch of size class `size` (`pace.size_class`)."""
        return self.paces.pace_in_class(signal, probe, size)

    def margin(self) -> float:
        """How much slower than the mean pace plans are sized for: `pace_margin_z` spreads of the
        pace book's recent price errors. A plan sized at the mean pace ends past its budget about
        half the time on a machine whose pace swings; the budget's share above the plan's price is
        the runtime monitor's to spend on a slow batch (it targets the budget itself)."""
        z, cap = self.config.pace_margin_z, self.config.max_pace_margin
        return min(cap, math.exp(z * self.paces.spread()))

    @property
    def correction(self) -> dict[str, float]:
        """Each observed signal's overall learned pace."""
        return self.paces.by_signal()

    def set_bandwidth(self, gbps: float) -> None:
        """The runtime monitor's measured link bandwidth replaces the profiled one."""
        self.cost: CostModel = self.cost.with_bandwidth(gbps)
        self.config = replace(self.config, bandwidth_gbps=gbps)

    def mix_for(self, task: str | None) -> ServedMix | LearnedDemand | None:
        """What prices this batch instead of the profile's demand: the workload's own curves once
        a shadow sample has come in, else the profiled tasks re-weighted by the verdicts; None for
        a hinted batch, or while nothing is learned (learning off, or fewer than two tasks)."""
        if task is not None or self.served_mix is None:
            return None
        if not (self.served_mix.is_active or self.learned.is_active):
            return None
        return self.learned if self.learned.is_active else self.served_mix
