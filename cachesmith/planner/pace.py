"""The planner's learned pace of the engine: measured / predicted TTFT per plan kind, learned from
executed batches, with what little is known about a specific kind shrunk toward its parent's.

In: `observe(signal, pace, probe=, num_tokens=)` after each monitored batch. Out: `pace(signal,
probe=, num_tokens=)`, the factor the cost model's TTFT is multiplied by for that kind of batch,
and `spread()`, how far the book's own prices have recently missed the batches that ran.

Why per kind and not per signal: the offline cost fit's bias is not one number per signal. Plans
that probe (the score needs extra layers over every token, or query-only probe passes) run other
kernels than CacheBlend's shallow family (kv_dev, 1, 0), and the fit's error grows with the batch
(the largest batches a burst forms are the fit's extrapolation; the simulator's replay-fitted
machine had a probe family at 1.19x over 4K tokens a batch and 1.9x over 8K while the shallow one
stayed at 1.01-1.14x). One factor per signal averages the two, so a deep probe plan in a burst was
planned at the shallow batches' pace and ran past its budget, where the runtime monitor cannot
cut the probe layers it has already paid for.
The levels are every batch -> signal -> (signal, family) -> (signal, family, size class); a level's
estimate is its own running mean shrunk toward its parent's by `prior` pseudo-observations, so one
odd batch of a rare kind moves it part of the way, and a kind never seen reads its parent's. The
root is the machine's pace over every batch: most of a profile's error on a machine is shared by
all plans (the machine runs them all slower or faster), so a signal the planner has not run yet
is priced at that pace, not at the raw model's. Without it, a planner choosing per batch between
two signals priced the rarely chosen one at 1.0 while the machine ran it at 1.1-1.25: its batches
ran late, and the choice did worse than either signal fixed (docs/adr/0022-pace-book.md).
Why a spread: a mean pace prices the typical batch, but a shared machine's pace swings (replays
ran batches at 0.5x to 3.6x their price within minutes), and a plan sized to end at its budget at
the mean pace ends past it about half the time. The planner sizes plans for a quantile of the
pace instead (`Planner.margin`), read from the recent errors of the prices this book gave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_PACE, MAX_PACE = 0.5, 2.0  # one wild batch (a page-fault storm) must not swing the planner
# Size classes double from here: <1K, 1-2K, 2-4K, 4-8K, ... A sub-1K batch's fixed per-request costs
# weigh more than a 2K one's; one class for both priced it low (ADR 0022, docs/adr/0022-pace-book.md).
SIZE_UNIT_TOKENS = 1024
EVERY = ("",)  # the root level's key: every batch, whatever its signal


def family(probe: int) -> str:
    """A plan's kernel family: "probe" when it runs probe layers, "shallow" for (S, w, 0)."""
    return "probe" if probe > 0 else "shallow"


def size_classes(num_tokens) -> np.ndarray:
    """0 below SIZE_UNIT_TOKENS prompt tokens a batch, then one class per doubling [M]."""
    sizes = np.maximum(np.asarray(num_tokens, float), 1.0)
    return np.maximum(0, np.floor(np.log2(sizes / SIZE_UNIT_TOKENS)) + 1).astype(int)


def size_class(num_tokens: int | None) -> int | None:
    return None if num_tokens is None else int(size_classes(num_tokens))


@dataclass
class _Level:
    mean: float = 1.0
    count: int = 0


@dataclass
class PaceBook:
    alpha: float = 0.3  # weight of the newest batch in a level's running mean
    prior: float = 2.0  # pseudo-observations of the parent level behind each level's estimate
    spread_alpha: float = 0.1  # weight of the newest batch's squared log error in the spread
    _levels: dict[tuple, _Level] = field(default_factory=dict)
    _error_sq: float = 0.0  # running mean of log(measured / priced)^2 over the batches priced
    _num_errors: int = 0
    # (signal, family, size class) -> pace, until the next batch is observed: every decision reads
    # a few per signal, and the levels only move when a batch is observed
    _memo: dict[tuple, float] = field(default_factory=dict, repr=False, compare=False)

    def observe(self, signal: str, pace: float, probe: int = 1, num_tokens: int | None = None) -> None:
        """A batch of this kind ran at `pace` x its predicted time (relative to the uncorrected
        cost model); every level it belongs to learns it."""
        if not pace > 0:
            return
        pace = min(max(pace, MIN_PACE), MAX_PACE)
        size = size_class(num_tokens)
        if EVERY in self._levels:  # the first batch was priced by the raw model: learning, not noise
            error_sq = math.log(pace / self._pace(signal, probe, size)) ** 2
            a = 1.0 if self._num_errors == 0 else self.spread_alpha
            self._error_sq = (1 - a) * self._error_sq + a * error_sq
            self._num_errors += 1
        for key in self._keys(signal, probe, size):
            level = self._levels.setdefault(key, _Level())
            level.mean = pace if level.count == 0 else (1 - self.alpha) * level.mean + self.alpha * pace
            level.count += 1
        self._memo.clear()

    def pace(self, signal: str, probe: int = 1, num_tokens: int | None = None) -> float:
        """The factor for this kind of batch: the most specific level, shrunk toward its parents."""
        return self._pace(signal, probe, size_class(num_tokens))

    def pace_in_class(self, signal: str, probe: int, size: int | None) -> float:
        """`pace` for a batch of size class `size` (`size_class`): a decision computes it once."""
        return self._pace(signal, probe, size)

    def _pace(self, signal: str, probe: int, size: int | None) -> float:
        key = (signal, family(probe), size)
        if key not in self._memo:
            self._memo[key] = self._walk_levels(signal, probe, size)
        return self._memo[key]

    def _walk_levels(self, signal: str, probe: int, size: int | None) -> float:
        estimate = 1.0
        for i, key in enumerate(self._keys(signal, probe, size)):
            level = self._levels.get(key)
            if level is None or level.count == 0:
                break
            if i == 0:  # the machine's pace over every batch: no parent but the raw model
                estimate = level.mean
                continue
            weight = level.count / (level.count + self.prior)
            estimate = weight * level.mean + (1 - weight) * estimate
        return estimate

    def spread(self) -> float:
        """The recent root-mean-square of log(measured / priced) over the batches this book priced,
        shrunk toward 0 by `prior` pseudo-observations (two batches say little about a machine)."""
        weight = self._num_errors / (self._num_errors + self.prior)
        return math.sqrt(weight * self._error_sq)

    def paces(self, signal: str, probe: int, num_tokens: np.ndarray) -> np.ndarray:
        """`pace` for many batch sizes [M] at once (the scheduler's candidate batches)."""
        classes = size_classes(num_tokens)
        out = np.ones(classes.shape)
        for c in np.unique(classes):
            out[classes == c] = self._pace(signal, probe, int(c))
        return out

    def by_signal(self) -> dict[str, float]:
        """Each observed signal's overall pace (reports, tests)."""
        return {key[0]: lv.mean for key, lv in self._levels.items() if len(key) == 1 and key != EVERY and lv.count}

    @staticmethod
    def _keys(signal: str, probe: int, size: int | None) -> list[tuple]:
        keys: list[tuple] = [EVERY, (signal,), (signal, family(probe))]
        if size is not None:
            keys.append((signal, family(probe), size))
        return keys
