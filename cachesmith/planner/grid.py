"""Vectorized TTFT over many (w, p) splits and a coverage grid at once: the planner's inner loop.

In: a `CostModel`, a `BatchShape` (or the summed per-request terms of many batches: the
scheduler's candidates), a signal, J (w, p) pairs and uniform coverages. Out: TTFT [J, K]; per-request
coverage rows go through `ttft_rows`. The same walk as `CostModel.schedule` (tests hold them equal), in closed form: a plan is
a few runs of identical layer passes (WarmUp, Probe, Patch), and over m identical passes of
compute c whose loads of b seconds each are queued at once on a link free at time a, the last
pass ends at max(t + m*c, a + b + c + (m - 1) * max(b, c)). So a decision costs a few dozen numpy
calls however deep the model is.
"""
from __future__ import annotations

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel, phase_seconds, step_features


def _run(t, link, m, c, b=None, ready=0.0):
    """(end of compute, link free time) after m identical passes; m is [J, 1], c and b [J|1, K]."""
    if b is None:
        return t + m * c, link
    a = np.maximum(link, ready)
    busy = m > 0
    end = np.maximum(t + m * c, a + b + c + (m - 1) * np.maximum(b, c))
    return np.where(busy, end, t), np.where(busy, a + m * b, link)


def ttft_grid(model: CostModel, shape: BatchShape, signal: str, pairs: tuple[tuple[int, int], ...],
              coverage_grid: np.ndarray) -> np.ndarray:
    """TTFT [J, K] for uniform coverages [K]."""
    grid = np.asarray(coverage_grid, float)
    c, q, p, _ = shape.arrays()
    totals = np.broadcast_to(request_terms(c, q, p).sum(0), (grid.size, len(TERMS)))
    return ttft_totals(model, signal, pairs, grid, totals)


def ttft_rows(model: CostModel, shape: BatchShape, signal: str, pairs: tuple[tuple[int, int], ...],
              cov: np.ndarray) -> np.ndarray:
    """TTFT [J, K] for per-request coverage rows cov [K, R]."""
    costs, bw = model.profile.layer_costs, model.bandwidth_gbps * 1e9

    def compute(kind, places=True):  # [1, K]
        return phase_seconds(costs[kind], step_features(kind, shape, cov, places))[None, :]

    def load(kind):  # [1, K] seconds on the link
        return (model.load_bytes(kind, shape, cov) / bw)[None, :]

    t0 = model.overhead_seconds(shape)
    return _walk(model.num_layers, signal, pairs, compute, load, np.full((len(pairs), cov.shape[0]), t0))


# per-request terms whose sums over a batch give every feature of a uniform-coverage plan
TERMS = ("n", "nn", "q", "qn", "qqp", "c", "cn", "p", "one")


def request_terms(context, suffix, prefix) -> np.ndarray:
    """[R, 9] terms (see TERMS) of R requests given their token counts; a batch's are the sum."""
    c, q, p = (np.atleast_1d(np.asarray(x, float)) for x in (context, suffix, prefix))
    n = c + q + p
    return np.stack([n, n * n, q, q * n, q * (q + p), c, c * n, p, np.ones_like(n)], 1)


def ttft_totals(model: CostModel, signal: str, pairs: tuple[tuple[int, int], ...], coverage,
                totals: np.ndarray) -> np.ndarray:
    """TTFT [J, M] of uniform-coverage plans for M batches given by their summed terms [M, 9], at
    coverage [M] (or one for all): one batch over a coverage grid, or the scheduler's hundreds of
    candidate batches at one coverage, in one walk."""
    n, nn, q, qn, qqp, c, cn, p, num = np.asarray(totals, float).T
    r = np.broadcast_to(np.asarray(coverage, float), n.shape)
    costs, per, bw = model.profile.layer_costs, model.profile.kv_bytes_per_token_layer, model.bandwidth_gbps * 1e9
    ones, zeros = np.ones_like(n), np.zeros_like(n)
    sel_rows, sel_pairs = r * c + q, r * cn + qn
    # (rows, attention pairs, aux rows when the pass places the cached rows) per kind; + requests
    feats = {"full": (n, nn, c + p), "qci_probe": (q, qn, c + p), "query_only": (q, qqp, zeros),
             "patch": (sel_rows, sel_pairs, c + p), "score_patch": (sel_rows, sel_pairs, n),
             "select": (c, zeros, zeros)}
    loads = {"full": (c + p) * per, "prefix": p * per, "reused": ((1.0 - r) * c + p) * per}

    def compute(kind, places=True):  # [1, M]
        rows, pairs_, aux = feats[kind]
        if not places and kind != "score_patch":
            aux = zeros
        return phase_seconds(costs[kind], np.stack([ones, rows, pairs_, aux, num], 1))[None, :]

    def load(kind):
        return (loads[kind] / bw)[None, :]

    t0 = phase_seconds(model.profile.overhead, np.stack([ones, n, zeros, zeros, num], 1))[None, :]
    return _walk(model.num_layers, signal, pairs, compute, load, t0)


def _walk(L: int, signal: str, pairs: tuple[tuple[int, int], ...], compute, load, t: np.ndarray) -> np.ndarray:
    """The layer walk of every (w, p) pair [J] over K columns, from batch start times t [J, K]."""
    w = np.array([p[0] for p in pairs], float)[:, None]  # [J, 1]
    p = np.array([p[1] for p in pairs], float)[:, None]
    t = t + np.zeros((len(pairs), 1))
    link = np.zeros_like(t)
    t, link = _run(t, link, w, compute("full", places=False))
    patch, reused, select = compute("patch"), load("reused"), compute("select")
    if signal == "qci":  # Patch over the probe layers places nothing (the probe did)
        t, link = _run(t, link, p, compute("qci_probe"), load("full"))
        selection, t = t, t + select
        t, link = _run(t, link, p, compute("patch", places=False))
        t, link = _run(t, link, L - w - p, patch, reused, selection)
    elif signal == "kv_dev":  # selects inside its scoring pass
        t, link = _run(t, link, p, compute("full"), load("full"))
        scoring = (w + p < L).astype(float)
        t, link = _run(t, link, scoring, compute("score_patch"), load("full"))
        t, link = _run(t, link, np.maximum(L - w - p - 1, 0), patch, reused, t)
    elif signal == "qci_last":
        t, link = _run(t, link, L - 1 - w, compute("query_only"), load("prefix"))
        t, link = _run(t, link, np.ones_like(w), compute("qci_probe"), load("full"))
        selection, t = t, t + select
        t, link = _run(t, link, L - 1 - w, patch, reused, selection)
        t, link = _run(t, link, np.ones_like(w), compute("patch", places=False))
    elif signal == "fused":  # qci_last's probe, then kv_dev's scoring pass at w selects
        t, link = _run(t, link, L - 1 - w, compute("query_only"), load("prefix"))
        t, link = _run(t, link, np.ones_like(w), compute("qci_probe"), load("full"))
        t, link = _run(t, link, np.ones_like(w), compute("score_patch"), load("full"))
        t, link = _run(t, link, np.maximum(L - 2 - w, 0), patch, reused, t)
        t, link = _run(t, link, np.ones_like(w), compute("patch", places=False))
    else:  # position: Patch from w, selection known at once
        selection, t = t, t + select * (L - w > 0)
        t, link = _run(t, link, L - w, patch, reused, selection)
    return t
