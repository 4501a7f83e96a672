"""The budget-aware recomputation planner (paper §5.1).

In: a batch of `PlanRequest`s (context/suffix/prefix tokens, each request's QCI entropy after the
first WarmUp layer, and the task it names, if any) and a budget in seconds. Out: a `BatchPlan`:
signal S, rank depth split (w, p) maximizing feasible coverage under the transfer-aware cost model,
per-request coverages from the greedy marginal-gain allocation, predicted TTFT and expected passes.
Outside the budget band [TTFT(S,1,1,r_min), TTFT(S,1,1,r_max)] a static plan is returned.
Every TTFT is the cost model's times the pace learned for that kind of batch (signal, whether the
plan probes, batch size class: `planner/pace.py`), so a deep probe plan in a burst is sized for the
pace such batches really ran at, not for the signal's average.

The signal: by default each signal's best plan is searched and, of those that fit the budget, the
one expecting the most passes under the demand of the served mix (or of the batch's task, when every
request names the same one and the profile has its curves) wins (`pick`). The paper's rule (batch
majority of "layer-0 QCI entropy > theta") is the `entropy` ablation: on the packaged model every
task's entropies overlap in 0.94-0.96, so the threshold splits requests of one task at random
(docs/decisions.md).
Never touches tensors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from cachesmith.errors import ConfigError, InputError
from cachesmith.planner.allocate import allocate, concave_envelope, expected_passes
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.demand import DemandModel, read_at
from cachesmith.planner.grid import ttft_grid, ttft_rows
from cachesmith.planner.pace import PaceBook
from cachesmith.planner.profile import Profile
from cachesmith.planner.learned_demand import LearnedDemand
from cachesmith.planner.served_mix import ServedMix
from cachesmith.planner.signal_choice import Evidence, robust_pick
from cachesmith.recompute import RecomputeConfig, fixed_splits

COVERAGE_GRID = np.round(np.arange(0, 51) * 0.02, 2)
# the signals the planner searches; ties between their plans go to the first. qci_last is
# FusionRAG's ranking after WarmUp layer 0: one family (1, L - 1) (`recompute.FIXED_FAMILIES`),
# planned where the profile holds its demand. fused (that ranking interleaved with KV deviation's)
# is planned only when fixed (`PlannerConfig.signal`): searched by default it lost grid wins
# against the old costs and, against the refit ones, won them but lost replays of fresh instances
# on the real model (docs/decisions.md)
SIGNALS = ("kv_dev", "qci", "qci_last")
FIXABLE_SIGNALS = (*SIGNALS, "fused")
SIGNAL_RULES = ("robust", "passes", "entropy")


@dataclass(frozen=True)
class PlannerConfig:
    r_min: float = 0.05  # budget floor: TTFT of (S, 1, 1, r_min)
    r_max: float = 0.50  # saturation: TTFT of (S, 1, 1, r_max)
    max_rank_fraction: float = 0.5  # deepest rank depth considered, as a fraction of the layers
    num_splits: int = 4  # (w, p) splits tried per rank depth
    entropy_threshold: float | None = None  # None: the profile's
    bandwidth_gbps: float | None = None  # None: the profile's fastest tier (the monitor updates it)
    signal: str | None = None  # fix the selection signal (ablation); None: chosen per batch by signal_rule
    # "robust": KV deviation unless another signal expects more passes under every demand the
    # profile knows by signal_margin_z standard errors (`signal_choice`); "passes": the most
    # expected passes under the batch's demand; "entropy": the paper's threshold (ablations)
    signal_rule: str = "robust"
    signal_margin_z: float = 1.0
    use_task_hint: bool = True  # a batch whose requests all name one task plans with that task's demand
    is_mix_learned: bool = False  # price hint-free batches with the served mix learned from verdicts
    # plans are sized to end inside the budget at the pace this many spreads of the pace book's
    # recent price errors above the mean, up to max_pace_margin x. 0 (at the mean) by default: on a
    # simulated swinging machine no z > 0 met more SLOs, the monitor absorbs slow batches already
    # (docs/decisions.md)
    pace_margin_z: float = 0.0
    max_pace_margin: float = 1.5

    def __post_init__(self) -> None:
        if self.signal not in (None, *FIXABLE_SIGNALS):
            raise ConfigError(f"signal={self.signal!r}: must be one of {', '.join(FIXABLE_SIGNALS)} or None "
                              f"(chosen per batch)")
        if self.signal_rule not in SIGNAL_RULES:
            raise ConfigError(f"signal_rule={self.signal_rule!r}: must be one of {', '.join(SIGNAL_RULES)}")
        if not 0 < self.r_min < self.r_max <= 1:
            raise ConfigError(f"need 0 < r_min ({self.r_min}) < r_max ({self.r_max}) <= 1")
        if not 0 < self.max_rank_fraction <= 1:
            raise ConfigError(f"max_rank_fraction={self.max_rank_fraction} must be in (0, 1]")
        if self.num_splits < 1:
            raise ConfigError(f"num_splits={self.num_splits} must be >= 1")
        if not 0 <= self.signal_margin_z <= 4:
            raise ConfigError(f"signal_margin_z={self.signal_margin_z} must be in [0, 4]")
        if not 0 <= self.pace_margin_z <= 4:
            raise ConfigError(f"pace_margin_z={self.pace_margin_z} must be in [0, 4]")
        if not 1 <= self.max_pace_margin <= 4:
            raise ConfigError(f"max_pace_margin={self.max_pace_margin} must be in [1, 4]")


@dataclass(frozen=True)
class PlanRequest:
    context_tokens: int
    suffix_tokens: int
    prefix_tokens: int = 0
    qci_entropy: float | None = None  # normalized entropy of layer-0 QCI scores, in [0, 1]
    task: str | None = None  # the task the request names (a hint), if any


@dataclass(frozen=True)
class BatchPlan:
    signal: str
    warmup: int
    probe: int
    coverages: tuple[float, ...]
    predicted_ttft_s: float
    expected_passes: float
    budget_s: float
    floor_s: float
    saturation_s: float
    status: str  # "planned", "below_floor" or "above_saturation" (static plan)
    decision_s: float = 0.0
    task: str | None = None  # whose demand priced the plan (None: the served mix's)

    @property
    def rank_depth(self) -> int:
        return self.warmup + self.probe

    def recompute_config(self) -> RecomputeConfig:
        """The batch's shared (S, w, p); each request's own coverage goes on its request."""
        return RecomputeConfig(self.signal, self.warmup, self.probe, max(self.coverages))


def pick(plans: list[BatchPlan], budget_s: float) -> BatchPlan:
    """The signal's plan to run: a plan that fits the budget beats one that does not, whatever
    passes the latter expects (a below-floor plan runs late, and the runtime monitor then cuts its
    coverage to near full reuse's: the passes it was chosen for never happen). Among those that
    fit, the most expected passes; among those that do not, the fastest. `max` keeps the first of
    equals: ties go to the faster plan, then SIGNALS' order."""
    def key(p: BatchPlan) -> tuple:
        fits = p.predicted_ttft_s <= budget_s * (1 + 1e-9)
        return fits, round(p.expected_passes, 9) if fits else 0.0, -round(p.predicted_ttft_s, 9)
    return max(plans, key=key)


class Planner:
    def __init__(self, profile: Profile, config: PlannerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or PlannerConfig()
        self.cost = CostModel(profile, self.config.bandwidth_gbps)
        self.demand = DemandModel(profile.demand)
        # hint-free batches' demand, learned from served requests' verdicts (`observe_verdict`)
        self.served_mix = ServedMix(self.demand) if self.config.is_mix_learned else None
        # the served workload's own curves, from shadow samples and verdicts (`observe_sample`)
        self.learned = LearnedDemand(self.demand) if self.config.is_mix_learned else None
        self.theta = self.config.entropy_threshold if self.config.entropy_threshold is not None \
            else profile.entropy_threshold
        L = profile.num_layers
        deepest = max(2, int(self.config.max_rank_fraction * L))
        # every depth up to 6, then a geometric-ish grid: demand changes slowly with depth there
        self.depths = sorted({int(d) for d in [*range(2, 7), *np.geomspace(6, deepest, 6).round()]
                              if 2 <= d <= deepest})
        self._envelopes: dict[tuple[str, int, str | None], tuple] = {}  # (signal, depth, task) -> (cdf, envelope)
        # the learned mix's, for its current weights only: (signal, depth) -> (cdf, envelope)
        self._mix_envelopes: dict[tuple[str, int], tuple] = {}
        self._mix_version: tuple[str, int] | None = None
        # measured / predicted TTFT per kind of batch, learned from executed batches (`observe`):
        # the offline cost fit is biased per signal, plan family and batch size (planner/pace.py)
        self.paces = PaceBook()
        self._pairs = {d: self._splits(d) for d in (1, *self.depths)}
        # signals with one (w, p) of their own: their probes always run to L
        self._fixed_pairs = fixed_splits(L)

    def warm_up(self) -> None:
        """Build every (signal, depth) coverage envelope now, not inside the first decisions."""
        for task in (None, *self.demand.tasks):
            for signal in self.demand.signals:
                for depth in self.signal_depths(signal):
                    self._envelope(signal, depth, task)

    def observe(self, signal: str, pace: float, probe: int = 1, num_tokens: int | None = None) -> None:
        """A batch of `signal` (probing `probe` layers, `num_tokens` prompt tokens) ran at `pace` x
        the uncorrected cost model's time: every level of the pace book learns it."""
        self.paces.observe(signal, pace, probe, num_tokens)

    def observe_verdict(self, signal: str, warmup: int, probe: int, coverage: float, passed: bool) -> None:
        """A served request's quality verdict under the (S, w, p) it ran and the coverage it ended
        with: the learned served mix (if any) takes it in."""
        if self.served_mix is not None:
            self.served_mix.observe(signal, warmup + probe, coverage, passed)
            self.learned.observe_verdict(signal, warmup + probe, coverage, passed)

    def observe_sample(self, intervals: dict[tuple[str, int], tuple[float, float]]) -> None:
        """A shadow sample: one served request's passing interval per (signal, anchor depth)."""
        if self.learned is not None:
            self.learned.observe_sample(intervals)

    def pace(self, signal: str, probe: int = 1, num_tokens: int | None = None) -> float:
        """The learned measured / predicted factor for this kind of batch (1.0 before any)."""
        return self.paces.pace(signal, probe, num_tokens)

    def margin(self) -> float:
        """How much slower than the mean pace plans are sized for: `pace_margin_z` spreads of the
        pace book's recent price errors. A plan sized at the mean pace ends past its budget about
        half the time on a machine whose pace swings; the budget's share above the plan's price is
        the runtime monitor's to spend on a slow batch (it targets the budget itself)."""
        z, cap = self.config.pace_margin_z, self.config.max_pace_margin
        return min(cap, math.exp(z * self.paces.spread()))

    @property
    def correction(self) -> dict[str, float]:
        """Each observed signal's overall learned pace."""
        return self.paces.by_signal()

    def set_bandwidth(self, gbps: float) -> None:
        """The runtime monitor's measured link bandwidth replaces the profiled one."""
        self.cost = self.cost.with_bandwidth(gbps)
        self.config = replace(self.config, bandwidth_gbps=gbps)

    def choose_signal(self, requests: list[PlanRequest]) -> str:
        """The paper's rule (the `entropy` ablation): batch majority of H > theta."""
        if self.config.signal is not None:
            return self.config.signal
        votes = [r.qci_entropy > self.theta for r in requests if r.qci_entropy is not None]
        if not votes:
            return "kv_dev"
        return "kv_dev" if 2 * sum(votes) > len(votes) else "qci"

    def shape(self, requests: list[PlanRequest]) -> BatchShape:
        if not requests:
            raise InputError("batch is empty: the planner needs at least one request")
        return BatchShape(tuple(r.context_tokens for r in requests), tuple(r.suffix_tokens for r in requests),
                          tuple(r.prefix_tokens for r in requests))

    def band(self, shape: BatchShape, signal: str) -> tuple[float, float]:
        t = ttft_grid(self.cost, shape, signal, (self.band_pair(signal),), np.array([self.config.r_min, self.config.r_max]))
        return float(t[0, 0]), float(t[0, 1])

    def band_pair(self, signal: str) -> tuple[int, int]:
        """The (w, p) of `signal`'s static plans and budget band: (1, 1), or its own fixed split."""
        return self._fixed_pairs.get(signal, (1, 1))

    def candidate_signals(self, requests: list[PlanRequest]) -> list[str]:
        if self.config.signal is not None:
            return [self.config.signal]
        if self.config.signal_rule == "entropy":
            return [self.choose_signal(requests)]
        return [s for s in SIGNALS if s in self.demand.signals] or ["kv_dev"]

    def batch_task(self, requests: list[PlanRequest]) -> str | None:
        """The task whose demand prices the batch: the one every request names, if the profile
        has its curves; otherwise None (the served mix)."""
        tasks = {r.task for r in requests}
        if not self.config.use_task_hint or len(tasks) != 1:
            return None
        (task,) = tasks
        return task if task in self.demand.tasks else None

    def _is_mixed(self, task: str | None) -> bool:
        """Whether this batch is priced with the learned served mix (hint-free, learning on)."""
        return task is None and self.served_mix is not None and (self.served_mix.is_active or self.learned.is_active)

    def _mix_source(self):
        """What prices hint-free batches while learning: the workload's own curves once a shadow
        sample has come in, else the profiled tasks re-weighted by the verdicts."""
        return self.learned if self.learned.is_active else self.served_mix

    def _cdf(self, signal: str, depth: int, task: str | None) -> np.ndarray:
        """The pass probability on the demand grid [21] this batch is priced with."""
        return self._mix_source().cdf(signal, depth) if self._is_mixed(task) else self.demand.cdf(signal, depth, task)

    def _envelope(self, signal: str, depth: int, task: str | None = None):
        if self._is_mixed(task):
            source = self._mix_source()
            version = (type(source).__name__, source.version)
            if self._mix_version != version:  # the weights or curves moved: rebuild them all
                self._mix_envelopes, self._mix_version = {}, version
            cache, key = self._mix_envelopes, (signal, depth)
        else:
            cache, key = self._envelopes, (signal, depth, task)
        if key not in cache:
            cdf = self._cdf(signal, depth, task)
            cache[key] = (cdf, concave_envelope(cdf))
        return cache[key]

    def _pass_probability(self, signal: str, depth: int, coverages, task: str | None) -> np.ndarray:
        return read_at(self._cdf(signal, depth, task), coverages)

    def signal_depths(self, signal: str) -> list[int]:
        """Rank depths searched for `signal`: depth 1 is kv_dev's (1, 0) (CacheBlend's family: the
        score taken at layer 1 from the fresh K/V projection), searched where the profile measured
        its demand; every other depth splits into w >= 1 WarmUp and p >= 1 probe layers."""
        if signal in self._fixed_pairs:
            return [sum(self._fixed_pairs[signal])]
        shallow = [1] if signal == "kv_dev" and 1 in self.demand.anchors(signal) else []
        return shallow + self.depths

    def signal_pairs(self, signal: str, depth: int) -> tuple[tuple[int, int], ...]:
        """The (w, p) splits of `depth` searched for `signal`."""
        if signal in self._fixed_pairs:
            return (self._fixed_pairs[signal],)
        return self._pairs.get(depth) or self._splits(depth)

    def _splits(self, depth: int) -> tuple[tuple[int, int], ...]:
        if depth == 1:
            return ((1, 0),)
        ws = np.unique(np.linspace(1, depth - 1, min(self.config.num_splits, depth - 1)).round().astype(int))
        return tuple((int(w), depth - int(w)) for w in ws)

    def plan(self, requests: list[PlanRequest], budget_s: float) -> BatchPlan:
        start = time.perf_counter()
        if not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise InputError(f"budget_s={budget_s!r} must be a positive number of seconds")
        shape = self.shape(requests)
        task = self.batch_task(requests)
        sized = budget_s / self.margin()  # plans fit this at the mean pace; the monitor targets budget_s
        plans = [self._plan_signal(shape, s, sized, task) for s in self.candidate_signals(requests)]
        if self.config.signal_rule == "robust" and len(plans) > 1:
            chosen = robust_pick(plans, sized, self.evidence(task), self.config.signal_margin_z, pick)
        else:
            chosen = pick(plans, sized)
        return replace(chosen, budget_s=budget_s, decision_s=time.perf_counter() - start)

    def evidence(self, task: str | None) -> list[Evidence]:
        """The demands a batch's signal choice must hold under: the hinted task's, or the served
        mix's and every task's the profile has curves for."""
        def under(t: str | None):
            return lambda plan: read_at(self._cdf(plan.signal, plan.rank_depth, t), plan.coverages)
        # a learned mix is the stream's own demand: the tasks' curves it re-weights are not tested apart
        groups = [task] if task is not None or self._is_mixed(task) else [None, *self.demand.tasks]
        return [Evidence(t, self.demand.task_size(t), under(t)) for t in groups]

    def _plan_signal(self, shape: BatchShape, signal: str, budget_s: float, task: str | None) -> BatchPlan:
        w, p = self.band_pair(signal)
        k = self.pace(signal, p, shape.num_tokens)  # the band's (S, w, p): sized for budget / k
        floor, saturation = (k * t for t in self.band(shape, signal))
        R = shape.num_requests
        if budget_s < floor or budget_s > saturation:
            if budget_s < floor:
                r, ttft = self.config.r_min, floor
            else:
                r, ttft = self._static_fill(shape, signal, budget_s / k)
                ttft *= k
            passes = float(self._pass_probability(signal, w + p, [r] * R, task).sum())  # static (S, w, p, r)
            return BatchPlan(signal, w, p, (r,) * R, ttft, passes, budget_s, floor, saturation,
                             "below_floor" if budget_s < floor else "above_saturation", task=task)
        (w, p), coverages, ttft, passes = self._search(shape, signal, budget_s, task)
        return BatchPlan(signal, w, p, tuple(coverages), ttft, passes, budget_s, floor, saturation,
                         "planned", task=task)

    def _static_fill(self, shape: BatchShape, signal: str, budget_s: float) -> tuple[float, float]:
        """Above saturation: the static (S, 1, 1, r) plan with the most coverage that fits. Accuracy
        converges toward full prefill there under any split (paper §5.1), so ranking deeper buys
        nothing; but budget the scheduler grants past saturation still buys coverage."""
        t = ttft_grid(self.cost, shape, signal, (self.band_pair(signal),), COVERAGE_GRID)[0]  # [K]
        fits = np.nonzero((t <= budget_s) & (COVERAGE_GRID >= self.config.r_max))[0]
        k = int(fits.max()) if fits.size else int(np.searchsorted(COVERAGE_GRID, self.config.r_max))
        return float(COVERAGE_GRID[k]), float(t[k])

    def best_splits(self, shape: BatchShape, signal: str, budget_s: float,
                    depths: list[int] | None = None) -> dict[int, tuple[tuple[int, int], float, float]]:
        """Per rank depth: the (w, p) split with the highest feasible uniform coverage, that
        coverage (-1 where none fits) and its TTFT at the learned pace of its family and batch
        size. Ties go to the shallower WarmUp."""
        depths = depths or self.signal_depths(signal)
        pairs = tuple(pair for d in depths for pair in self.signal_pairs(signal, d))
        ttft = ttft_grid(self.cost, shape, signal, pairs, COVERAGE_GRID) * self._paces(signal, pairs, shape)  # [J, K]
        feasible = ttft <= budget_s
        # the highest feasible coverage per pair: monotone in the budget even where a slow link
        # makes TTFT fall with coverage (fewer reused rows to load)
        max_index = np.where(feasible.any(1), feasible.shape[1] - 1 - np.argmax(feasible[:, ::-1], 1), -1)
        out = {}
        for depth in depths:
            js = [j for j, (w, p) in enumerate(pairs) if w + p == depth]
            j = max(js, key=lambda i: (max_index[i], -pairs[i][0]))
            k = max_index[j]
            out[int(depth)] = ((int(pairs[j][0]), int(pairs[j][1])), float(COVERAGE_GRID[k]) if k >= 0 else -1.0,
                               float(ttft[j, k]) if k >= 0 else float("inf"))
        return out

    def _paces(self, signal: str, pairs: tuple[tuple[int, int], ...], shape: BatchShape) -> np.ndarray:
        """The learned pace of each (w, p) pair's family at this batch size [J, 1]: two lookups, as
        a pair's family is only whether it probes."""
        by_family = {is_probe: self.pace(signal, int(is_probe), shape.num_tokens) for is_probe in (False, True)}
        return np.array([[by_family[p > 0]] for _, p in pairs])

    def _search(self, shape: BatchShape, signal: str, budget_s: float, task: str | None = None):
        """Candidates per rank depth: its best split's uniform plan (known to fit) and the
        allocation of the same tokens (checked). The feasible one with the most expected passes
        wins (ties: the shallower depth, uniform first); the answer is exact over this set, so
        it never falls as the budget grows."""
        candidates = []
        for depth, ((w, p), r, t) in self.best_splits(shape, signal, budget_s).items():
            if r < 0:
                continue
            cdf, envelope = self._envelope(signal, depth, task)
            uniform = [r] * shape.num_requests
            candidates.append((expected_passes(uniform, cdf), -depth, 1, (w, p), uniform, t))
            alloc = allocate(shape.context_tokens, r * sum(shape.context_tokens), cdf, envelope)
            candidates.append((expected_passes(alloc, cdf), -depth, 0, (w, p), alloc, None))
        for passes, _, _, pair, coverages, t in sorted(candidates, key=lambda c: c[:3], reverse=True):
            if t is None:
                t = float(ttft_rows(self.cost, shape, signal, (pair,), np.array([coverages]))[0, 0]
                          * self._paces(signal, (pair,), shape)[0, 0])
            if t <= budget_s:
                return pair, coverages, t, passes
        cov = [self.config.r_min] * shape.num_requests  # nothing fits even at 0%
        w, p = self.band_pair(signal)
        t = float(self.cost.ttft(shape, signal, w, p, np.array(cov))[0]) * self.pace(signal, p, shape.num_tokens)
        return (w, p), cov, t, float(self._pass_probability(signal, w + p, cov, task).sum())
