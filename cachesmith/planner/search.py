"""The search for the batch's plan of every signal at once, vectorized over the signals' (w, p)
splits and rank depths, the requests and the coverage grid (paper §5.1).

In: a `SearchSpace` (the searched signals' (w, p) pairs by rank depth, stacked: config and profile
only, built once), their demand under the batch's (`StackedDemand`), the paced TTFT of every pair
at every grid coverage [J, K] (the signals' walks, `PassCosts.walk`), the pairs' paces, which
signals' budget falls inside their band, and the budget. Out: per signal a `Found` plan (None
outside the band, or where nothing fits even at 0%): per rank depth the split with the most
feasible uniform coverage, then per depth that uniform plan and the greedy allocation of the same
tokens; the feasible one with the most expected passes (ties: the shallower depth, uniform first).
Exact over this candidate set, so it never falls as the budget grows. Only the allocations ranked
above a signal's best uniform plan are priced (`RowPricer`, walked on floats): a uniform plan fits
by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachesmith.planner.allocate import allocate_many, expected_passes_many
from cachesmith.planner.demand_tables import StackedDemand
from cachesmith.planner.grid import RowPricer
from cachesmith.planner.walk import run_counts, walk_one

COVERAGE_GRID = np.round(np.arange(0, 51) * 0.02, 2)
NUM_GRID = COVERAGE_GRID.size


@dataclass(frozen=True)
class SplitTable:
    """A signal's searched (w, p) pairs, grouped by rank depth (WarmUp ascending within each)."""
    signal: str
    pairs: tuple[tuple[int, int], ...]  # [J]
    depths: tuple[int, ...]  # [D]
    is_probe: np.ndarray  # [J, 1]: the pair's plan family (whether it runs probe layers)
    group_rows: np.ndarray  # [D, W] pair rows of each depth, padded with its first (shallowest WarmUp) row
    band_row: int  # the row of the band's (w, p)
    counts: tuple  # each run's pass count of every pair [J, 1] (`walk.run_counts`)
    row_counts: tuple[tuple, ...]  # [J] the same, per pair, as floats

    @classmethod
    def of(cls, signal: str, depth_pairs: list[tuple[int, tuple[tuple[int, int], ...]]],
           band_pair: tuple[int, int], num_layers: int) -> "SplitTable":
        pairs = [pair for _, group in depth_pairs for pair in group]
        if band_pair not in pairs:  # walked for the band only, never searched
            pairs.append(band_pair)
        num_pairs, width = len(pairs), max(len(group) for _, group in depth_pairs)
        group_rows = np.zeros((len(depth_pairs), width), int)
        start = 0
        for d, (_, group) in enumerate(depth_pairs):
            group_rows[d] = start  # padding repeats the first row: it never beats it in an argmax
            group_rows[d, :len(group)] = np.arange(start, start + len(group))
            start += len(group)
        w = np.array([pair[0] for pair in pairs], float)[:, None]
        p = np.array([pair[1] for pair in pairs], float)[:, None]
        counts = run_counts(signal, w, p, num_layers)
        row_counts = tuple(tuple(None if m is None else float(m.m[j, 0]) for m in counts) for j in range(num_pairs))
        return cls(signal, tuple(pairs), tuple(d for d, _ in depth_pairs), p > 0, group_rows,
                   pairs.index(band_pair), counts, row_counts)


@dataclass(frozen=True)
class SearchSpace:
    """The split tables of the signals a decision searches, stacked one signal after the other:
    pair rows [J] and rank depths [D]."""
    tables: tuple[SplitTable, ...]
    row_starts: np.ndarray  # [S + 1] each signal's first pair row
    depth_starts: np.ndarray  # [S + 1] each signal's first depth
    group_rows: np.ndarray  # [D, W] the pair rows of each depth
    pair_signals: np.ndarray  # [J] whose pair each row is
    depth_signals: np.ndarray  # [D] whose depth each is
    is_probe: np.ndarray  # [J, 1]

    @classmethod
    def of(cls, tables: list[SplitTable]) -> "SearchSpace":
        num_pairs = [len(t.pairs) for t in tables]
        num_depths = [len(t.depths) for t in tables]
        row_starts, depth_starts = np.cumsum([0, *num_pairs]), np.cumsum([0, *num_depths])
        width = max(t.group_rows.shape[1] for t in tables)
        group_rows = np.concatenate([_widen(t.group_rows, width) + start for t, start in zip(tables, row_starts)])
        return cls(tuple(tables), row_starts, depth_starts, group_rows, np.repeat(np.arange(len(tables)), num_pairs),
                   np.repeat(np.arange(len(tables)), num_depths), np.concatenate([t.is_probe for t in tables]))

    def paces(self, shallow: list[float], probe: list[float]) -> np.ndarray:
        """Each pair's pace [J, 1] from each signal's pace of its two plan families."""
        return np.where(self.is_probe, np.array(probe)[self.pair_signals][:, None],
                        np.array(shallow)[self.pair_signals][:, None])


def _widen(group_rows: np.ndarray, width: int) -> np.ndarray:
    """Pad [D, W] pair rows to [D, width] with each depth's first row, as `SplitTable.of` pads."""
    return np.concatenate([group_rows, group_rows[:, :1].repeat(width - group_rows.shape[1], 1)], 1)


@dataclass(frozen=True)
class Found:
    pair: tuple[int, int]
    coverages: tuple[float, ...]
    ttft_s: float
    expected_passes: float


def best_splits(ttft: np.ndarray, group_rows: np.ndarray, budget_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per rank depth [D]: the row of the pair with the highest feasible uniform coverage on the
    grid (ties: the shallower WarmUp) and that coverage's grid index (-1 where none fits), from
    paced TTFT [J, K] and each depth's pair rows [D, W]."""
    feasible = ttft <= budget_s
    # the highest feasible coverage per pair: monotone in the budget even where a slow link
    # makes TTFT fall with coverage (fewer reused rows to load)
    max_index = np.where(feasible.any(1), feasible.shape[1] - 1 - feasible[:, ::-1].argmax(1), -1)  # [J]
    best = max_index[group_rows].argmax(1)  # [D] the first max: the shallowest WarmUp
    rows = group_rows[np.arange(best.size), best]
    return rows, max_index[rows]


@dataclass(frozen=True)
class _Candidates:
    """Per rank depth that fits [V]: its best split's row and grid index, the allocation of that
    uniform plan's tokens [V, R] and the expected passes of both [V]."""
    rows: np.ndarray
    index: np.ndarray
    allocations: np.ndarray
    uniform_passes: np.ndarray
    allocated_passes: np.ndarray


def search(pricer: RowPricer, space: SearchSpace, demand: StackedDemand, ttft: np.ndarray, paces: np.ndarray,
           budget_s: float, is_in_band: np.ndarray) -> list[Found | None]:
    """Every signal's plan from paced TTFT [J, K], the pairs' paces [J, 1] and which signals'
    budget is inside their band [S]. `pricer` prices the batch's allocations."""
    rows, index = best_splits(ttft, space.group_rows, budget_s)  # [D] each
    fitting = ((index >= 0) & is_in_band[space.depth_signals]).nonzero()[0]  # [V]
    if not fitting.size:
        return [None] * len(space.tables)
    candidates = _candidates(pricer, demand, fitting, rows[fitting], index[fitting])
    bounds = np.searchsorted(fitting, space.depth_starts).tolist()  # each signal's slice of the candidates
    return [_choose(pricer, table, space.row_starts[s], candidates, slice(bounds[s], bounds[s + 1]), ttft, paces,
                    budget_s) if bounds[s + 1] > bounds[s] else None for s, table in enumerate(space.tables)]


def _candidates(pricer: RowPricer, demand: StackedDemand, depths: np.ndarray, rows: np.ndarray,
                index: np.ndarray) -> _Candidates:
    coverage = COVERAGE_GRID[index]  # [V]
    context = pricer.shape.context_tokens
    is_all = depths.size == len(demand.cdfs)
    cdfs = demand.cdfs if is_all else demand.cdfs[depths]  # [V, 21]
    envelopes = demand.envelopes if is_all else demand.envelopes.rows(depths)
    allocations = allocate_many(context, coverage * float(sum(context)), envelopes)  # [V, R]
    uniform_passes = expected_passes_many(coverage[:, None].repeat(len(context), 1), cdfs)  # [V]
    return _Candidates(rows, index, allocations, uniform_passes, expected_passes_many(allocations, cdfs))


def _choose(pricer: RowPricer, table: SplitTable, row_start: int, candidates: _Candidates, mine: slice,
            ttft: np.ndarray, paces: np.ndarray, budget_s: float) -> Found:
    """One signal's plan among its candidates (`mine`, in depth order)."""
    uniform, allocated = candidates.uniform_passes[mine], candidates.allocated_passes[mine]  # [V_s]
    rows, index, allocations = candidates.rows[mine], candidates.index[mine], candidates.allocations[mine]
    # candidates rank by (passes, shallower depth, uniform first)
    best = int(uniform.argmax())
    is_above = (allocated > uniform[best]) | ((allocated == uniform[best]) & (np.arange(uniform.size) < best))
    above = is_above.nonzero()[0]
    # only allocations ranked above the best uniform plan need a price: a uniform plan fits by construction
    checked = above[np.lexsort((above, -allocated[above]))]
    fit = _first_fit(pricer, table, allocations[checked], rows[checked] - row_start, paces[rows[checked]],
                     budget_s) if checked.size else None
    if fit is not None:
        v, t = checked[fit[0]], fit[1]
        return Found(table.pairs[rows[v] - row_start], tuple(allocations[v].tolist()), t, float(allocated[v]))
    j, k = rows[best], index[best]
    return Found(table.pairs[j - row_start], (float(COVERAGE_GRID[k]),) * allocations.shape[1], float(ttft[j, k]),
                 float(uniform[best]))


def _first_fit(pricer: RowPricer, table: SplitTable, coverages: np.ndarray, rows: np.ndarray, paces: np.ndarray,
               budget_s: float) -> tuple[int, float] | None:
    """(position, paced TTFT) of the first of C allocations [C, R] that fits, allocation c under
    the pair of the table's row rows[c] at pace paces[c]; None if none does."""
    for c, (seconds, loads) in enumerate(pricer.prices(coverages)):
        t = walk_one(table.signal, table.row_counts[rows[c]], seconds, loads, pricer.start) * float(paces[c, 0])
        if t <= budget_s:
            return c, t
    return None
