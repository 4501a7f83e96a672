"""Vectorized TTFT over many (w, p) splits and a coverage grid at once: the planner's inner loop.

In: a `CostModel`, a `BatchShape` (or the summed per-request terms of many batches: the
scheduler's candidates), a signal, J (w, p) pairs and uniform coverages. Out: TTFT [J, K];
per-request coverage rows go through `ttft_rows`. Each prices every pass kind of the batch, then
walks the signal's runs of identical layer passes in closed form (`planner/walk.py`: the same walk
as `CostModel.schedule`, tests hold them equal), so a decision costs a few dozen numpy calls
however deep the model is.

A decision prices its batch once (`uniform_costs`: every pass kind's seconds at every coverage
column, one batched matmul; `PassCosts.walk` then walks each signal's pairs over those columns),
and `RowPricer` prices the per-request coverage rows of the few allocations it checks, each walked
on floats (`walk.walk_one`). Both keep the float operations of `ttft_grid` / `ttft_rows` (a
matmul's rounding depends on whether it multiplies one row or many, so rows stay rows): a plan's
TTFT is the same bits either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel, phase_seconds, step_features
from cachesmith.planner.walk import run_counts, walk_arrays

# every (pass kind, places cached rows) a walk prices, then the per-batch overhead: `PassCosts` rows
PASS_KEYS = (("full", False), ("full", True), ("qci_probe", True), ("query_only", True), ("select", True),
             ("patch", True), ("patch", False), ("score_patch", True))
NUM_FIXED_KEYS = 5  # the leading keys whose features do not depend on coverage
COEFFICIENT_KINDS = (*(kind for kind, _ in PASS_KEYS), "overhead")  # rows of `CostModel.coefficient_table`


@dataclass(frozen=True)
class PassCosts:
    """Seconds of every pass kind and link load over M columns [1, M], and the batch start [1, M]."""
    seconds: dict[tuple[str, bool], np.ndarray]
    loads: dict[str, np.ndarray]
    start: np.ndarray

    def walk(self, signal: str, counts: tuple) -> np.ndarray:
        """When the last pass ends for each plan of `signal` given by its run counts [J, 1]: [J, M]."""
        return walk_arrays(signal, counts, self.seconds.__getitem__, self.loads.__getitem__, self.start)


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

    def compute(key):  # [1, K]
        kind, places = key
        return phase_seconds(costs[kind], step_features(kind, shape, cov, places))[None, :]

    def load(kind):  # [1, K] seconds on the link
        return (model.load_bytes(kind, shape, cov) / bw)[None, :]

    t0 = model.overhead_seconds(shape)
    return _walk_pairs(model.num_layers, signal, pairs, compute, load, np.full((len(pairs), cov.shape[0]), t0))


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

    def compute(key):  # [1, M]
        kind, places = key
        rows, pairs_, aux = feats[kind]
        if not places and kind != "score_patch":
            aux = zeros
        return phase_seconds(costs[kind], np.stack([ones, rows, pairs_, aux, num], 1))[None, :]

    def load(kind):
        return (loads[kind] / bw)[None, :]

    t0 = phase_seconds(model.profile.overhead, np.stack([ones, n, zeros, zeros, num], 1))[None, :]
    return _walk_pairs(model.num_layers, signal, pairs, compute, load, t0)


def uniform_costs(model: CostModel, totals: np.ndarray, coverage: np.ndarray) -> PassCosts:
    """Every pass kind's seconds for one batch of summed terms [9] at M uniform coverages, as
    `ttft_totals` prices them: one batched matmul of [num_keys, M, 5] features."""
    n, nn, q, qn, qqp, c, cn, p, num = totals.tolist()  # floats: the same values, cheaper to lay out
    r = np.asarray(coverage, float)  # [M]
    cp = c + p
    rows = [[1.0, n, nn, 0.0, num], [1.0, n, nn, cp, num], [1.0, q, qn, cp, num], [1.0, q, qqp, 0.0, num],
            [1.0, c, 0.0, 0.0, num],  # the fixed keys, then the Patch keys' (rows, pairs set below), overhead
            [1.0, 0.0, 0.0, cp, num], [1.0, 0.0, 0.0, 0.0, num], [1.0, 0.0, 0.0, n, num], [1.0, n, 0.0, 0.0, num]]
    feats = np.repeat(np.array(rows)[:, None, :], r.size, 1)  # [num_keys + overhead, M, 5]
    feats[NUM_FIXED_KEYS:-1, :, 1] = r * c + q
    feats[NUM_FIXED_KEYS:-1, :, 2] = r * cn + qn
    coefs = model.coefficient_table(COEFFICIENT_KINDS)[:, :, None]
    seconds = np.maximum(np.matmul(feats, coefs)[..., 0], 0.0)[:, None, :]  # [num_keys + overhead, 1, M]
    per, bw = model.profile.kv_bytes_per_token_layer, model.bandwidth_gbps * 1e9
    loads = {"full": np.array([[cp * per / bw]]), "prefix": np.array([[p * per / bw]]),
             "reused": (((1.0 - r) * c + p) * per / bw)[None, :]}
    return PassCosts(dict(zip(PASS_KEYS, seconds)), loads, seconds[-1])


@dataclass(frozen=True)
class _FixedPrices:
    """What no coverage row changes: the seconds of the passes that read every row, the full and
    prefix loads, the batch start (its overhead) and each Patch key's aux rows [3, 1]."""
    seconds: dict[tuple[str, bool], float]
    loads: dict[str, float]
    start: float
    patch_aux: np.ndarray


class RowPricer:
    """Prices plans with per-request coverages [C, R] of one batch as `ttft_rows` prices each row
    alone (a one-row matmul is a dot product: the batched one below keeps it one), as floats for
    `walk.walk_one`. What no coverage changes is priced on the first call only."""

    def __init__(self, model: CostModel, shape: BatchShape) -> None:
        self.model, self.shape = model, shape
        self._fixed: _FixedPrices | None = None

    def _price_fixed(self) -> _FixedPrices:
        c, q, p, n = self.shape.arrays()
        # the sums step_features and load_bytes take, as floats (the same values, cheaper to lay out)
        n_sum, nn, q_sum, qn, qqp, c_sum, placed, p_sum = (float(x.sum()) for x in (
            n, n * n, q, q * n, q * (q + p), c, c + p, p))
        num = float(len(c))
        feats = np.array([[1.0, n_sum, nn, 0.0, num], [1.0, n_sum, nn, placed, num], [1.0, q_sum, qn, placed, num],
                          [1.0, q_sum, qqp, 0.0, num], [1.0, c_sum, 0.0, 0.0, num],
                          [1.0, n_sum, 0.0, 0.0, num]])  # the fixed keys, then the overhead
        table = self.model.coefficient_table(COEFFICIENT_KINDS)
        coefs = np.concatenate([table[:NUM_FIXED_KEYS], table[-1:]])[:, :, None]  # [6, 5, 1]
        seconds = np.maximum(np.matmul(feats[:, None, :], coefs), 0.0)[:, 0, 0].tolist()
        per, bw = self.model.profile.kv_bytes_per_token_layer, self.model.bandwidth_gbps * 1e9
        # the Patch keys' aux rows: the placed cached rows, none, every row (score_patch)
        return _FixedPrices(dict(zip(PASS_KEYS, seconds[:NUM_FIXED_KEYS])),
                            {"full": placed * per / bw, "prefix": p_sum * per / bw}, seconds[-1],
                            np.array([[placed], [0.0], [n_sum]]))

    @property
    def fixed(self) -> _FixedPrices:
        if self._fixed is None:
            self._fixed = self._price_fixed()
        return self._fixed

    @property
    def start(self) -> float:
        """The batch's overhead: when its first pass starts."""
        return self.fixed.start

    def prices(self, cov: np.ndarray) -> list[tuple[dict, dict]]:
        """Per coverage row: (seconds of each pass key, link seconds of each load)."""
        fixed, (c, q, p, n) = self.fixed, self.shape.arrays()
        sel = cov * c + q  # [C, R]
        patch_keys = PASS_KEYS[NUM_FIXED_KEYS:]
        feats = np.empty((len(patch_keys), cov.shape[0], 5))  # [3, C, 5]
        feats[:, :, 0], feats[:, :, 1], feats[:, :, 2], feats[:, :, 4] = 1.0, sel.sum(1), (sel * n).sum(1), len(c)
        feats[:, :, 3] = fixed.patch_aux
        coefs = self.model.coefficient_table(COEFFICIENT_KINDS)[NUM_FIXED_KEYS:-1, :, None]  # [3, 5, 1]
        if cov.shape[0] > 1:
            coefs = np.repeat(coefs, cov.shape[0], 0)
        seconds = np.maximum(np.matmul(feats.reshape(-1, 1, 5), coefs), 0.0).reshape(len(patch_keys), -1)  # [3, C]
        per, bw = self.model.profile.kv_bytes_per_token_layer, self.model.bandwidth_gbps * 1e9
        reused = ((((1.0 - cov) * c).sum(1) + p.sum()) * per / bw).tolist()  # [C]
        return [({**fixed.seconds, **dict(zip(patch_keys, row))}, {**fixed.loads, "reused": r})
                for row, r in zip(seconds.T.tolist(), reused)]


def _walk_pairs(L: int, signal: str, pairs: tuple[tuple[int, int], ...], compute, load, t: np.ndarray) -> np.ndarray:
    """The layer walk of every (w, p) pair [J] over K columns, from batch start times t [1|J, K]."""
    w = np.array([p[0] for p in pairs], float)[:, None]  # [J, 1]
    p = np.array([p[1] for p in pairs], float)[:, None]
    return walk_arrays(signal, run_counts(signal, w, p, L), compute, load, t)
