"""Transfer-aware TTFT cost model (paper §5.1): per-layer compute times from the profile, KV
transfers over a link of given bandwidth, walked layer by layer in the runner's execution order
(a layer starts when the previous one ended and its KV has arrived).

In: a `Profile`, a `BatchShape` and a plan (signal, w, p, per-request coverages; vectorized over
K candidate coverage rows). Out: predicted TTFT seconds [K], or the per-step schedule. Stall time
is not wasted: raising coverage grows compute into it without raising TTFT, which is how the
planner recomputes "for free" while a slow link delivers KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cachesmith.errors import InputError
from cachesmith.planner.profile import PhaseCost, Profile


@dataclass(frozen=True)
class BatchShape:
    context_tokens: tuple[int, ...]  # per request: tokens in its chunks (what coverage is relative to)
    suffix_tokens: tuple[int, ...]
    prefix_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.context_tokens)
        if n == 0:
            raise InputError("batch is empty: at least one request is needed")
        if len(self.suffix_tokens) != n or len(self.prefix_tokens) != n:
            raise InputError("context_tokens, suffix_tokens and prefix_tokens must have one entry per request")
        if min(self.context_tokens) < 1 or min(self.suffix_tokens) < 1 or min(self.prefix_tokens) < 0:
            raise InputError("every request needs >= 1 context and suffix token (prefix >= 0)")

    @classmethod
    def uniform(cls, num_requests: int, context: int, suffix: int = 32, prefix: int = 0) -> "BatchShape":
        return cls((context,) * num_requests, (suffix,) * num_requests, (prefix,) * num_requests)

    @property
    def num_requests(self) -> int:
        return len(self.context_tokens)

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        c = np.asarray(self.context_tokens, float)
        q = np.asarray(self.suffix_tokens, float)
        p = np.asarray(self.prefix_tokens, float)
        return c, q, p, c + q + p

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(context, suffix, prefix, total) tokens per request, as float arrays."""
        return self._arrays


@dataclass(frozen=True)
class Step:
    layer: int
    kind: str  # a key of Profile.layer_costs
    load: str  # "none", "full" (whole layer, issued at start), "prefix", "reused" (after selection)


def execution_steps(signal: str, warmup: int, probe: int, num_layers: int) -> list[Step]:
    """The runner's layer passes in order (recompute/runner.py), one `Step` each."""
    L, w, p = num_layers, min(warmup, num_layers), probe
    steps = [Step(i, "full", "none") for i in range(w)]
    if w >= L:
        return steps
    if signal == "kv_dev":
        steps += [Step(i, "full", "full") for i in range(w, w + p)]
        start = w + p
        if start >= L:
            return steps
        return steps + [Step(start, "score_patch", "full")] + [Step(i, "patch", "reused") for i in range(start + 1, L)]
    if signal == "qci":
        steps += [Step(i, "qci_probe", "full") for i in range(w, w + p)]
        return steps + [Step(i, "patch", "none" if i < w + p else "reused") for i in range(w, L)]
    if signal == "qci_last":
        steps += [Step(i, "query_only", "prefix") for i in range(w, L - 1)] + [Step(L - 1, "qci_probe", "full")]
        return steps + [Step(i, "patch", "none" if i == L - 1 else "reused") for i in range(w, L)]
    return steps + [Step(i, "patch", "reused") for i in range(w, L)]  # position


def step_features(kind: str, shape: BatchShape, coverages: np.ndarray) -> np.ndarray:
    """[K, 4] features (1, rows, attention pairs, aux rows) of one pass; coverages is [K, R]. Aux rows
    are all rows for score_patch (it scores them) and the cached rows for patch (it places them)."""
    c, q, p, n = shape.arrays()
    K = coverages.shape[0]
    if kind == "full":
        rows, pairs, aux = n.sum(), (n * n).sum(), 0.0
    elif kind == "qci_probe":
        rows, pairs, aux = q.sum(), (q * n).sum(), 0.0
    elif kind == "query_only":
        rows, pairs, aux = q.sum(), (q * (q + p)).sum(), 0.0
    else:  # patch / score_patch: the selected context rows and the suffix, over all n keys
        sel = coverages * c + q  # [K, R]
        rows, pairs = sel.sum(1), (sel * n).sum(1)
        # aux: score_patch scores every row; a patch pass places every cached row (RoPE to its
        # assembled position, copied into the cache) before the selected ones overwrite theirs
        aux = n.sum() if kind == "score_patch" else (c + p).sum()
    out = np.empty((K, 4))
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = 1.0, rows, pairs, aux
    return out


def phase_seconds(cost: PhaseCost, feats: np.ndarray) -> np.ndarray:
    coef = np.array([cost.intercept_s, cost.per_row_s, cost.per_pair_s, cost.per_aux_s])
    return np.maximum(feats @ coef, 0.0)


class CostModel:
    def __init__(self, profile: Profile, bandwidth_gbps: float | None = None) -> None:
        self.profile = profile
        self.num_layers = profile.num_layers
        self.bandwidth_gbps = bandwidth_gbps or max(profile.tier_gbps.values(), default=10.0)
        if not self.bandwidth_gbps > 0:
            raise InputError(f"bandwidth_gbps={self.bandwidth_gbps} must be positive")

    def with_bandwidth(self, gbps: float) -> "CostModel":
        return CostModel(self.profile, gbps)

    def load_bytes(self, load: str, shape: BatchShape, coverages: np.ndarray) -> np.ndarray:
        c, _, p, _ = shape.arrays()
        per = self.profile.kv_bytes_per_token_layer
        if load == "none":
            return np.zeros(coverages.shape[0])
        if load == "full":
            return np.full(coverages.shape[0], (c + p).sum() * per)
        if load == "prefix":
            return np.full(coverages.shape[0], p.sum() * per)
        return (((1.0 - coverages) * c).sum(1) + p.sum()) * per

    def schedule(self, shape: BatchShape, signal: str, warmup: int, probe: int,
                 coverages: np.ndarray) -> tuple[list[Step], np.ndarray]:
        """(steps, end times [num_steps, K]) from the start of the batch."""
        coverages = np.atleast_2d(np.asarray(coverages, float))  # [K, R]
        steps = execution_steps(signal, warmup, probe, self.num_layers)
        K, bw = coverages.shape[0], self.bandwidth_gbps * 1e9
        kinds = {s.kind for s in steps}
        compute = {k: phase_seconds(self.profile.layer_costs[k], step_features(k, shape, coverages)) for k in kinds}
        loads = {ld: self.load_bytes(ld, shape, coverages) / bw for ld in {s.load for s in steps}}
        n = shape.arrays()[3]
        t = np.full(K, phase_seconds(self.profile.overhead, np.array([[1.0, n.sum(), 0.0, 0.0]]))[0])
        link = np.zeros(K)
        selection = None  # when the selection is known: patch row loads are issued then
        ends = np.empty((len(steps), K))
        for j, step in enumerate(steps):
            if step.kind == "patch" and selection is None:
                selection = t
            if step.load != "none":
                ready = selection if (step.load == "reused" and selection is not None) else 0.0
                link = np.maximum(link, ready) + loads[step.load]
                t = np.maximum(t, link)
            t = t + compute[step.kind]
            if step.kind == "score_patch":
                selection = t
            ends[j] = t
        return steps, ends

    def ttft(self, shape: BatchShape, signal: str, warmup: int, probe: int, coverages) -> np.ndarray:
        """Predicted TTFT [K] for coverage rows [K, R] (or one row [R])."""
        _, ends = self.schedule(shape, signal, warmup, probe, coverages)
        return ends[-1] if len(ends) else np.zeros(np.atleast_2d(coverages).shape[0])

    def full_prefill_ttft(self, shape: BatchShape) -> float:
        return float(self.ttft(shape, "position", self.num_layers, 0, np.zeros(shape.num_requests))[0])
