"""The demand a decision prices plans with, as tables built once per demand instead of per decision.

In: the profile's `DemandModel` (the served mix's curves and each task's), the learned mix's
source while the planner learns one (`ServedMix` or `LearnedDemand`: its tables are rebuilt when
its version moves), and each signal's searched rank depths. Out: per (signal, demand) a
`SignalDemand`: the pass curves at those depths [D, 21], their concave envelopes for the
allocation (`allocate.EnvelopeTable`), and every demand's pass curve of one plan family stacked
for the signal choice's evidence.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from cachesmith.planner.allocate import EnvelopeTable, concave_envelope
from cachesmith.planner.demand import DemandModel


@dataclass(frozen=True)
class StackedDemand:
    """Several signals' pass curves at their searched depths, one signal after the other."""
    cdfs: np.ndarray  # [D, 21]
    envelopes: EnvelopeTable


@dataclass(frozen=True)
class SignalDemand:
    """One signal's pass curves under one demand at its searched rank depths."""
    depths: tuple[int, ...]
    cdfs: np.ndarray  # [D, 21]
    _read: Callable[[int], np.ndarray] = field(repr=False)  # a depth outside `depths`

    @classmethod
    def of(cls, depths: Sequence[int], read: Callable[[int], np.ndarray]) -> "SignalDemand":
        return cls(tuple(depths), np.stack([read(d) for d in depths]), read)

    @cached_property
    def _rows(self) -> dict[int, int]:
        return {d: i for i, d in enumerate(self.depths)}

    @cached_property
    def envelopes(self) -> EnvelopeTable:
        """Built on the first search under this demand: the signal choice reads only the curves."""
        return EnvelopeTable.of([concave_envelope(cdf) for cdf in self.cdfs])

    def cdf(self, depth: int) -> np.ndarray:
        """The pass curve at `depth` [21]."""
        row = self._rows.get(depth)
        return self.cdfs[row] if row is not None else self._read(depth)


class DemandTables:
    """`SignalDemand`s by (signal, task) for the profile's demands, and by signal for the learned
    mix at its current version; the same stacked for a search (`searched`) and for the signal
    choice's evidence (`evidence_cdfs`)."""

    def __init__(self, demand: DemandModel, depths_of: Callable[[str], list[int]]) -> None:
        self.demand = demand
        self._depths_of = depths_of
        self.profiled: dict[tuple[str, str | None], SignalDemand] = {}
        self.mixed: dict[str, SignalDemand] = {}  # the learned mix's, for `mix_version` only
        self.mix_version: tuple[str, int] | None = None
        self._evidence: dict[tuple, np.ndarray] = {}  # (signal, depth, tasks) -> [G, 21]
        self._profiled_searched: dict[tuple, StackedDemand] = {}  # (signals, task) -> the profile's, stacked
        self._mix_searched: dict[tuple[str, ...], StackedDemand] = {}  # signals -> the mix's, at mix_version

    def get(self, signal: str, task: str | None, mix=None) -> SignalDemand:
        """`signal`'s curves under `task`'s demand (None: the served mix's), or under `mix` (a
        `ServedMix` or `LearnedDemand`) when one is given."""
        if mix is None:
            key = (signal, task)
            if key not in self.profiled:
                self.profiled[key] = SignalDemand.of(self._depths_of(signal),
                                                     lambda d: self.demand.cdf(signal, d, task))
            return self.profiled[key]
        version = (type(mix).__name__, mix.version)
        if self.mix_version != version:  # the weights or curves moved: rebuild them all
            self.mixed, self._mix_searched, self.mix_version = {}, {}, version
        if signal not in self.mixed:
            self.mixed[signal] = SignalDemand.of(self._depths_of(signal), lambda d: mix.cdf(signal, d))
        return self.mixed[signal]

    def searched(self, signals: tuple[str, ...], task: str | None, mix=None) -> StackedDemand:
        """`get` of each of `signals`, stacked for one search of them all."""
        demands = [self.get(s, task, mix) for s in signals]  # first: a moved mix drops the stacks too
        cache, key = (self._profiled_searched, (signals, task)) if mix is None else (self._mix_searched, signals)
        if key not in cache:
            cache[key] = StackedDemand(np.concatenate([d.cdfs for d in demands]),
                                       EnvelopeTable.stack([d.envelopes for d in demands]))
        return cache[key]

    def evidence_cdfs(self, signal: str, depth: int, tasks: tuple[str | None, ...]) -> np.ndarray:
        """The profile's pass curves of (signal, depth) under each of `tasks` [G, 21]."""
        key = (signal, depth, tasks)
        if key not in self._evidence:
            self._evidence[key] = np.stack([self.get(signal, t).cdf(depth) for t in tasks])
        return self._evidence[key]
