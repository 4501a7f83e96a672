"""Vectorized TTFT over many (w, p) splits and a coverage grid at once: the planner's inner loop.

In: a `CostModel`, a `BatchShape`, a signal, J (w, p) pairs and K uniform coverages. Out: TTFT
[J, K]. Same walk as `CostModel.schedule` (tests hold them equal), but every split and coverage
advance together one step at a time, so a decision costs tens of numpy calls instead of thousands.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel, _seconds, execution_steps, step_features

# step codes: (layer kind, what it loads)
CODES = (("pad", "none"), ("full", "none"), ("full", "full"), ("qci_probe", "full"), ("query_only", "prefix"),
         ("score_patch", "full"), ("patch", "none"), ("patch", "reused"))
_CODE = {kl: i for i, kl in enumerate(CODES)}


@lru_cache(maxsize=256)
def encode(signal: str, pairs: tuple[tuple[int, int], ...], num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes [J, S], selection step [J]: the step after which the selection is known, -1 = start)."""
    seqs, sel = [], []
    for w, p in pairs:
        steps = execution_steps(signal, w, p, num_layers)
        seqs.append([_CODE[(s.kind, s.load)] for s in steps])
        kinds = [s.kind for s in steps]
        if "score_patch" in kinds:
            sel.append(kinds.index("score_patch"))
        elif "patch" in kinds:
            sel.append(kinds.index("patch") - 1)
        else:
            sel.append(len(steps))  # never: no patch step
    width = max(len(s) for s in seqs)
    codes = np.zeros((len(seqs), width), dtype=np.int64)
    for j, s in enumerate(seqs):
        codes[j, :len(s)] = s
    return codes, np.array(sel)


def ttft_grid(model: CostModel, shape: BatchShape, signal: str, pairs: tuple[tuple[int, int], ...],
              coverage_grid: np.ndarray) -> np.ndarray:
    codes, sel_step = encode(signal, pairs, model.num_layers)
    K, R = coverage_grid.size, shape.num_requests
    cov = np.repeat(coverage_grid[:, None], R, axis=1)  # [K, R]
    profile = model.profile
    compute = np.zeros((len(CODES), K))
    nbytes = np.zeros((len(CODES), K))
    for code, (kind, load) in enumerate(CODES):
        if kind != "pad":
            compute[code] = _seconds(profile.layer_costs[kind], step_features(kind, shape, cov))
            nbytes[code] = model._bytes(load, shape, cov)
    _, _, _, n = shape.arrays()
    t0 = _seconds(profile.overhead, np.array([[1.0, n.sum(), 0.0, 0.0]]))[0]
    J = codes.shape[0]
    t = np.full((J, K), t0)
    link = np.zeros((J, K))
    sel = np.where((sel_step == -1)[:, None], t0, np.inf) * np.ones((J, K))
    bw = model.bandwidth_gbps * 1e9
    is_reused = np.array([load == "reused" for _, load in CODES])
    for s in range(codes.shape[1]):
        code = codes[:, s]
        load = nbytes[code]  # [J, K]
        has_load = load > 0
        ready = np.where(is_reused[code][:, None], sel, 0.0)
        link = np.where(has_load, np.maximum(link, ready) + load / bw, link)
        t = np.where(has_load, np.maximum(t, link), t) + compute[code]
        sel = np.where((sel_step == s)[:, None], t, sel)
    return t
