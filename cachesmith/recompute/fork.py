"""A ranked batch patched at any coverages, as often as asked (`BatchRunner.fork`).

In: the runner and its `Ranked` batch (after WarmUp and Probe). Out: per run, one
`RecomputeOutput` per request at the coverages asked; forks of one plan patch together as one
batch. An offline search over coverages (profiling, outcome tables) pays for the ranking once.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from cachesmith.errors import ConfigError, InputError
from cachesmith.recompute.config import check_coverage
from cachesmith.recompute.hooks import RunnerHooks
from cachesmith.recompute.run_state import Ranked, RecomputeOutput, num_cloned
from cachesmith.recompute.sequence import Sequence


class Patcher(Protocol):
    """What a fork needs of its runner (`BatchRunner`, which builds forks: it imports this module)."""

    def patch(self, ranked: Ranked, hooks: RunnerHooks) -> list[RecomputeOutput]: ...


class PatchFork:
    """A ranked batch (`BatchRunner.fork`) patched at any coverages, as often as asked. Each run
    patches copies of the ranked state, so runs do not see each other: the first Patch layer's
    hidden rows and kv_dev's projections are only read, and each copy's cache holds the layers the
    ranking wrote (later layers are rotated as Patch reaches them, or were stitched up front)."""

    def __init__(self, runner: Patcher, ranked: Ranked) -> None:
        self.runner, self.ranked = runner, ranked
        # [0, patch_start) hold WarmUp and Probe rows; a probe may also have placed later layers
        self._num_written = max([ranked.patch_start] + [i + 1 for s in ranked.seqs for i in s.placed_layers])

    def run(self, coverages: list[float]) -> list[RecomputeOutput]:
        """The batch's outputs with request i patched at `coverages[i]`."""
        return PatchFork.run_together([self], [coverages])[0]

    def _copies(self, coverages: list[float]) -> list[Sequence]:
        if len(coverages) != len(self.ranked.seqs):
            raise InputError(f"coverages: {len(coverages)} given for {len(self.ranked.seqs)} requests")
        return [replace(s, coverage=check_coverage(c, f"coverages[{i}]"), selected=None,
                        placed_layers=set(s.placed_layers), cache=s.cache.clone(num_cloned(s, self._num_written)))
                for i, (s, c) in enumerate(zip(self.ranked.seqs, coverages))]

    @staticmethod
    def run_together(forks: list["PatchFork"], coverages: list[list[float]]) -> list[list[RecomputeOutput]]:
        """Several forks of one plan (e.g. of different requests) patched as one batch: their rows
        share each Patch layer's projections, as a served batch's do. Per fork, its outputs."""
        starts = {f.ranked.patch_start for f in forks}
        if len(starts) != 1 or len({f.runner for f in forks}) != 1:
            raise ConfigError(f"forks patched together need one runner and one first Patch layer, got {sorted(starts)}")
        seqs = [s for f, c in zip(forks, coverages) for s in f._copies(c)]
        kvs = [f.ranked.start_kv for f in forks]
        start_kv = None if kvs[0] is None else tuple(torch.cat(parts) for parts in zip(*kvs))
        ranked = Ranked(seqs, torch.cat([f.ranked.h for f in forks]), starts.pop(), start_kv)
        with torch.inference_mode():
            outputs = forks[0].runner.patch(ranked, RunnerHooks())
        sizes = [len(f.ranked.seqs) for f in forks]
        return [outputs[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(forks))]
