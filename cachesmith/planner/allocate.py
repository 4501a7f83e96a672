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
the expected number of passing requests never falls as the budget grows. All in numpy.
"""
from __future__ import annotations

from collections.abc import Sequence

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
