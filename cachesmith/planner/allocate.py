"""Coverage allocation across a batch's requests (paper §5.1): spend a batch's recomputed-token
budget where it buys the most passing probability.

In: context lengths, a token budget and P(pass | coverage) on the 5% grid (shared by the batch:
one signal and rank depth). Out: per-request coverages on that grid.

Every request has the same pass curve, so its upper concave envelope is shared too: a segment k
of it gains slope s_k per grid step, and costs 5% x context tokens per step for request i, i.e.
s_k / c_i per token. Taking (request, segment) moves in falling order of that ratio is the
greedy marginal-gain allocation; for concave curves it ends where the paper's pairwise token
transfers from a uniform start end (no transfer raises the expectation). Unlike the transfers, the
move order does not depend on the budget, so a bigger budget only extends the prefix taken, and
the expected number of passing requests never falls as the budget grows. All in numpy:
`allocate_many` allocates under D curves at once (a search's rank depths, each with its own
budget), from their envelopes padded into one `EnvelopeTable`, move for move as `allocate`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STEP = 0.05
NUM_STEPS = 20


def concave_envelope(cdf: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(levels of the hull's vertices, starting at 0; gain per level step of each segment).
    The planner caches it per (signal, depth)."""
    y = np.maximum.accumulate(np.asarray(cdf, float))  # a CDF never decreases; guard rounding
    vertices = [0]
    for x in range(1, len(y)):
        vertices.append(x)
        while len(vertices) >= 3:  # drop the middle point if it lies on or below the chord
            a, b, c = vertices[-3:]
            if (y[b] - y[a]) * (c - a) <= (y[c] - y[a]) * (b - a):
                vertices.pop(-2)
            else:
                break
    v = np.array(vertices)
    slopes = np.diff(y[v]) / np.diff(v)
    keep = np.concatenate([[True], slopes > 0])  # flat tail segments buy nothing
    v = v[keep]
    return v, np.diff(y[v]) / np.diff(v)


def allocate(context_tokens: Sequence[int], token_budget: float, cdf: Sequence[float],
             envelope: tuple[np.ndarray, np.ndarray] | None = None) -> list[float]:
    """Per-request coverage (multiples of 5%) with sum(coverage * context) <= token_budget.
    `envelope` (from `concave_envelope(cdf)`) may be passed in by callers that cache it."""
    ctx = np.asarray(context_tokens, float)
    vertices, slopes = envelope if envelope is not None else concave_envelope(cdf)
    if slopes.size == 0:
        return [0.0] * ctx.size
    steps = np.diff(vertices)  # grid steps per segment
    # moves[i, k]: request i advances over segment k
    # a request without context (a plain chat) has nothing to recompute: its steps cost nothing,
    # so it climbs the whole grid first and its pass rate counts the same under every plan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.nan_to_num(slopes[None, :] / (STEP * ctx[:, None]), nan=np.inf)
    cost = steps[None, :] * STEP * ctx[:, None]
    order = np.argsort(-ratio, axis=None, kind="stable")
    taken = np.cumsum(cost.ravel()[order]) <= token_budget + 1e-9
    num = int(np.argmin(taken)) if not taken.all() else taken.size
    level = np.zeros(ctx.size, dtype=int)
    req, seg = np.unravel_index(order[:num], ratio.shape)
    np.maximum.at(level, req, vertices[seg + 1])
    return np.round(level * STEP, 4).tolist()


def expected_passes(coverages: Sequence[float], cdf: Sequence[float]) -> float:
    index = (np.asarray(coverages, float) * (1 / STEP) + 1e-9).astype(int)
    return float(np.asarray(cdf, float)[np.minimum(index, NUM_STEPS)].sum())


@dataclass(frozen=True)
class EnvelopeTable:
    """The concave envelopes of D pass curves (one per rank depth), padded to the longest:
    what `allocate_many` walks, built once per demand (`of`)."""
    vertex_ends: np.ndarray  # [D, S] the level each segment ends at (0 on padding)
    step_costs: np.ndarray  # [D, S] coverage each segment buys: its grid steps x STEP (0 on padding)
    slopes: np.ndarray  # [D, S] gain per grid step (0 on padding)
    is_real: np.ndarray  # [D, S] False on padding

    def rows(self, rows: np.ndarray) -> "EnvelopeTable":
        """The envelopes of curves `rows` only."""
        return EnvelopeTable(self.vertex_ends[rows], self.step_costs[rows], self.slopes[rows], self.is_real[rows])

    @classmethod
    def stack(cls, tables: Sequence["EnvelopeTable"]) -> "EnvelopeTable":
        """Tables one after the other, padded to the widest."""
        width = max(t.slopes.shape[1] for t in tables)

        def pad(name: str) -> np.ndarray:
            return np.concatenate([np.pad(getattr(t, name), ((0, 0), (0, width - t.slopes.shape[1]))) for t in tables])
        return cls(pad("vertex_ends"), pad("step_costs"), pad("slopes"), pad("is_real"))

    @classmethod
    def of(cls, envelopes: Sequence[tuple[np.ndarray, np.ndarray]]) -> "EnvelopeTable":
        num_segments = max(1, *(slopes.size for _, slopes in envelopes))
        shape = (len(envelopes), num_segments)
        ends, steps, slopes, real = np.zeros(shape, int), np.zeros(shape, int), np.zeros(shape), np.zeros(shape, bool)
        for d, (vertices, segment_slopes) in enumerate(envelopes):
            size = segment_slopes.size
            ends[d, :size], steps[d, :size] = vertices[1:], np.diff(vertices)
            slopes[d, :size], real[d, :size] = segment_slopes, True
        return cls(ends, steps * STEP, slopes, real)


def allocate_many(context_tokens: np.ndarray, token_budgets: np.ndarray, table: EnvelopeTable) -> np.ndarray:
    """`allocate` for each of D curves at once, curve d with token_budgets[d]: per-request
    coverages [D, R], the same floats `allocate` returns (its move order, stable, per curve)."""
    ctx = np.asarray(context_tokens, float)  # [R]
    num_curves, num_segments = table.slopes.shape
    num_moves = ctx.size * num_segments
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = table.slopes[:, None, :] / (STEP * ctx)[None, :, None]  # [D, R, S]
    # padding sorts after every real move (a real -ratio is < 0, or -inf for a request without context)
    key = np.where(table.is_real[:, None, :], -ratio, np.inf).reshape(num_curves, num_moves)
    # flat indices of each curve's moves in its own order [D, R * S]
    order = np.argsort(key, axis=1, kind="stable") + (np.arange(num_curves) * num_moves)[:, None]
    cost = (table.step_costs[:, None, :] * ctx[None, :, None]).ravel()  # [D * R * S]
    spent = np.cumsum(cost[order], 1)  # [D, R * S]
    taken = np.empty(cost.size, bool)
    taken[order] = spent <= (np.asarray(token_budgets, float) + 1e-9)[:, None]  # a prefix: costs are >= 0
    taken = taken.reshape(num_curves, ctx.size, num_segments) & table.is_real[:, None, :]  # [D, R, S]
    # a request's taken segments are a prefix of its own (its ratios fall), so its level is the last one's end
    level = np.where(taken, table.vertex_ends[:, None, :], 0).max(2)  # [D, R]
    return np.round(level * STEP, 4)


def expected_passes_many(coverages: np.ndarray, cdfs: np.ndarray) -> np.ndarray:
    """`expected_passes` of coverage rows [D, R], row d under pass curve cdfs[d] [D, 21]: [D]."""
    index = (np.asarray(coverages, float) * (1 / STEP) + 1e-9).astype(int)
    return cdfs[np.arange(len(cdfs))[:, None], np.minimum(index, NUM_STEPS)].sum(1)
