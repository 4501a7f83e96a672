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
        # no context is a plain chat (nothing stored to stitch); a suffix is always computed
        if min(self.context_tokens) < 0 or min(self.suffix_tokens) < 1 or min(self.prefix_tokens) < 0:
            raise InputError("every request needs >= 1 suffix token (context and prefix >= 0)")

    @classmethod
    def uniform(cls, num_requests: int, context: int, suffix: int = 32, prefix: int = 0) -> "BatchShape":
        return cls((context,) * num_requests, (suffix,) * num_requests, (prefix,) * num_requests)

    @property
    def num_requests(self) -> int:
        return len(self.context_tokens)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens of the whole batch (prefix, context and suffix)."""
        return sum(self.context_tokens) + sum(self.suffix_tokens) + sum(self.prefix_tokens)

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
    places: bool = False  # the first pass of its layer to read cached KV: rotates every cached row into place
    selects: bool = False  # the selection (ranking, row loads, Patch row plans) runs just before it


def execution_steps(signal: str, warmup: int, probe: int, num_layers: int) -> list[Step]:
    """The runner's layer passes in order (recompute/runner.py), one `Step` each. kv_dev selects
    inside its scoring pass (`score_patch`); the other signals select between passes, just before
    the first Patch pass (`selects`). A layer's cached rows are placed (`places`) by the first pass
    of that layer that reads them: a probe layer's, so QCI's Patch passes over its probe layers
    (and FusionRAG's and the fused family's over their last layer) place nothing. The fused family
    runs qci_last's probe, then scores layer w as kv_dev does and selects inside that pass."""
    L, w, p = num_layers, min(warmup, num_layers), probe
    steps = [Step(i, "full", "none") for i in range(w)]
    if w >= L:
        return steps
    if signal == "kv_dev":
        steps += [Step(i, "full", "full", places=True) for i in range(w, w + p)]
        start = w + p
        if start >= L:
            return steps
        return steps + [Step(start, "score_patch", "full", places=True)] + [
            Step(i, "patch", "reused", places=True) for i in range(start + 1, L)]
    if signal == "qci":
        steps += [Step(i, "qci_probe", "full", places=True) for i in range(w, w + p)]
        return steps + [Step(i, "patch", "none" if i < w + p else "reused", places=i >= w + p, selects=i == w)
                        for i in range(w, L)]
    if signal == "qci_last":
        steps += [Step(i, "query_only", "prefix") for i in range(w, L - 1)] + [
            Step(L - 1, "qci_probe", "full", places=True)]
        return steps + [Step(i, "patch", "none" if i == L - 1 else "reused", places=i < L - 1, selects=i == w)
                        for i in range(w, L)]
    if signal == "fused":  # qci_last's probe, then kv_dev's scoring pass at w (it selects there)
        steps += [Step(i, "query_only", "prefix") for i in range(w, L - 1)] + [
            Step(L - 1, "qci_probe", "full", places=True), Step(w, "score_patch", "full", places=True)]
        return steps + [Step(i, "patch", "none" if i == L - 1 else "reused", places=i < L - 1)
                        for i in range(w + 1, L)]
    return steps + [Step(i, "patch", "reused", places=True, selects=i == w) for i in range(w, L)]  # position


NUM_FEATURES = 5  # (1, rows, attention pairs, aux rows, requests): `PhaseCost.coefficients` order


def step_features(kind: str, shape: BatchShape, coverages: np.ndarray, places: bool = True) -> np.ndarray:
    """[K, 5] features (1, rows, attention pairs, aux rows, requests) of one pass; coverages is [K, R].
    Aux rows: the cached rows a pass places (RoPE to their assembled positions; `Step.places`), and
    every row for score_patch (it projects and scores them all); requests prices the per-request
    work of a pass (its attention, RoPE and cache writes run request by request). The "select"
    kind prices a plan's selection: (1, context rows, 0, 0, requests)."""
    c, q, p, n = shape.arrays()
    K = coverages.shape[0]
    placed = (c + p).sum() if places else 0.0
    if kind == "full":
        rows, pairs, aux = n.sum(), (n * n).sum(), placed
    elif kind == "qci_probe":
        rows, pairs, aux = q.sum(), (q * n).sum(), placed
    elif kind == "query_only":
        rows, pairs, aux = q.sum(), (q * (q + p)).sum(), 0.0
    elif kind == "select":
        rows, pairs, aux = c.sum(), 0.0, 0.0
    else:  # patch / score_patch: the selected context rows and the suffix, over all n keys
        sel = coverages * c + q  # [K, R]
        rows, pairs = sel.sum(1), (sel * n).sum(1)
        aux = n.sum() if kind == "score_patch" else placed
    out = np.empty((K, NUM_FEATURES))
    out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] = 1.0, rows, pairs, aux, len(c)
    return out


def overhead_features(shape: BatchShape) -> np.ndarray:
    """[1, 5] features of the per-batch overhead: (1, all tokens, 0, 0, requests). Staging and
    assembling scale with the prompt's tokens (cached rows are all but the suffix's few, so they
    are not a feature of their own here) and with the requests (an entry set, a cache, a sequence
    each); the placed cached rows are priced in the Patch passes."""
    n = shape.arrays()[3]
    return np.array([[1.0, n.sum(), 0.0, 0.0, len(n)]])


def phase_seconds(cost: PhaseCost, feats: np.ndarray) -> np.ndarray:
    return np.maximum(feats @ np.array(cost.coefficients()), 0.0)


class CostModel:
    def __init__(self, profile: Profile, bandwidth_gbps: float | None = None) -> None:
        self.profile = profile
        self.num_layers = profile.num_layers
        self.bandwidth_gbps = bandwidth_gbps or max(profile.tier_gbps.values(), default=10.0)
        if not self.bandwidth_gbps > 0:
            raise InputError(f"bandwidth_gbps={self.bandwidth_gbps} must be positive")
        self._coefficient_tables: dict[tuple[str, ...], np.ndarray] = {}

    def coefficient_table(self, kinds: tuple[str, ...]) -> np.ndarray:
        """[len(kinds), 5] cost coefficients of each layer kind ("overhead": the per-batch overhead),
        built once per model: decisions price every kind at once with it."""
        if kinds not in self._coefficient_tables:
            costs = {**self.profile.layer_costs, "overhead": self.profile.overhead}
            self._coefficient_tables[kinds] = np.array([costs[kind].coefficients() for kind in kinds])
        return self._coefficient_tables[kinds]

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
        costs = self.profile.layer_costs
        compute = {(kind, places): phase_seconds(costs[kind], step_features(kind, shape, coverages, places))
                   for kind, places in {(s.kind, s.places) for s in steps}}
        loads = {ld: self.load_bytes(ld, shape, coverages) / bw for ld in {s.load for s in steps}}
        t = np.full(K, self.overhead_seconds(shape))
        link = np.zeros(K)
        selection = None  # when the selection is known: patch row loads are issued then
        ends = np.empty((len(steps), K))
        for j, step in enumerate(steps):
            if step.kind == "patch" and selection is None:
                selection = t
            if step.selects:
                t = t + self.select_seconds(shape)
            if step.load != "none":
                ready = selection if (step.load == "reused" and selection is not None) else 0.0
                link = np.maximum(link, ready) + loads[step.load]
                t = np.maximum(t, link)
            t = t + compute[(step.kind, step.places)]
            if step.kind == "score_patch":
                selection = t
            ends[j] = t
        return steps, ends

    def overhead_seconds(self, shape: BatchShape) -> float:
        return float(phase_seconds(self.profile.overhead, overhead_features(shape))[0])

    def select_seconds(self, shape: BatchShape) -> float:
        """The selection of a plan that selects between passes (all but kv_dev and full prefill)."""
        feats = step_features("select", shape, np.zeros((1, shape.num_requests)))
        return float(phase_seconds(self.profile.layer_costs["select"], feats)[0])

    def ttft(self, shape: BatchShape, signal: str, warmup: int, probe: int, coverages) -> np.ndarray:
        """Predicted TTFT [K] for coverage rows [K, R] (or one row [R])."""
        _, ends = self.schedule(shape, signal, warmup, probe, coverages)
        return ends[-1] if len(ends) else np.zeros(np.atleast_2d(coverages).shape[0])

    def full_prefill_ttft(self, shape: BatchShape) -> float:
        """The per-batch overhead, then every layer's full pass with nothing to load: `ttft` of a full
        prefill in closed form (admission prices each new document with it, on the event loop)."""
        feats = step_features("full", shape, np.zeros((1, shape.num_requests)), places=False)
        per_layer = float(phase_seconds(self.profile.layer_costs["full"], feats)[0])
        return self.overhead_seconds(shape) + self.num_layers * per_layer
