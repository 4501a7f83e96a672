"""The budget-aware recomputation planner (paper §5.1).

In: a batch of `PlanRequest`s (context/suffix/prefix tokens, each request's QCI entropy after the
first WarmUp layer, and the task it names, if any) and a budget in seconds. Out: a `BatchPlan`:
signal S, rank depth split (w, p) maximizing feasible coverage under the transfer-aware cost model,
per-request coverages from the greedy marginal-gain allocation, predicted TTFT and expected passes.
Outside the budget band [TTFT(S,1,1,r_min), TTFT(S,1,1,r_max)] a static plan is returned.
Every TTFT is the cost model's times the pace learned for that kind of batch (signal, whether the
plan probes, batch size class: `planner/pace.py`, learned in `planner/learning.py`), so a deep
probe plan in a burst is sized for the pace such batches really ran at, not for the signal's average.

The signal: by default each signal's best plan is searched and, of those that fit the budget, the
one expecting the most passes under the demand of the served mix (or of the batch's task, when every
request names the same one and the profile has its curves) wins (`pick`). The paper's rule (batch
majority of "layer-0 QCI entropy > theta") is the `entropy` ablation: on the packaged model every
task's entropies overlap in 0.94-0.96, so the threshold splits requests of one task at random
(docs/adr/0020-signal-choice.md).

A decision prices the batch once over the coverage grid and the band's two coverages (every pass
kind at once, `planner/grid.py`), walks each signal's splits over those columns (`planner/walk.py`)
and searches every signal inside its band in one pass of numpy (`planner/search.py`); the splits,
pass curves and envelopes it reads are built once per profile (`planner/demand_tables.py`). What a
planner is asked and answers is `planner/config.py`; what it learns while serving,
`planner/learning.py`. Never touches tensors.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from cachesmith.errors import InputError
from cachesmith.planner.config import FIXABLE_SIGNALS, SIGNAL_RULES, SIGNALS, BatchPlan, PlannerConfig, PlanRequest
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.demand import DemandModel, read_at, read_index
from cachesmith.planner.demand_tables import DemandTables, SignalDemand
from cachesmith.planner.grid import PassCosts, RowPricer, request_terms, ttft_grid, uniform_costs
from cachesmith.planner.learning import OnlineLearning
from cachesmith.planner.pace import size_class
from cachesmith.planner.profile import Profile
from cachesmith.planner.search import COVERAGE_GRID, NUM_GRID, Found, SearchSpace, SplitTable, best_splits, search
from cachesmith.planner.signal_choice import EvidenceTable, pick, robust_pick
from cachesmith.recompute import fixed_splits

__all__ = ["COVERAGE_GRID", "FIXABLE_SIGNALS", "SIGNALS", "SIGNAL_RULES", "BatchPlan", "Planner", "PlannerConfig",
           "PlanRequest", "pick"]


class Planner(OnlineLearning):
    def __init__(self, profile: Profile, config: PlannerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or PlannerConfig()
        self.cost = CostModel(profile, self.config.bandwidth_gbps)
        self.demand = DemandModel(profile.demand)
        self._init_learning(self.demand)
        self.theta = self.config.entropy_threshold if self.config.entropy_threshold is not None \
            else profile.entropy_threshold
        L = profile.num_layers
        deepest = max(2, int(self.config.max_rank_fraction * L))
        # every depth up to 6, then a geometric-ish grid: demand changes slowly with depth there
        self.depths = sorted({int(d) for d in [*range(2, 7), *np.geomspace(6, deepest, 6).round()]
                              if 2 <= d <= deepest})
        self._pairs = {d: self._splits(d) for d in (1, *self.depths)}
        # signals with one (w, p) of their own: their probes always run to L
        self._fixed_pairs = fixed_splits(L)
        # the columns a decision prices: the coverage grid, then the band's r_min and r_max
        self._columns = np.concatenate([COVERAGE_GRID, [self.config.r_min, self.config.r_max]])
        self._split_tables: dict[str, SplitTable] = {}
        self._spaces: dict[tuple[str, ...], SearchSpace] = {}  # by the signals a decision searches
        self.tables = DemandTables(self.demand, self.signal_depths)
        self._num_profiled: dict[tuple[str | None, ...], np.ndarray] = {}
        self._build_tables()

    def _build_tables(self) -> None:
        """What every decision reads and only the profile and config decide: each signal's splits,
        every demand's pass curves, and the served mix's envelopes (a task's come with its first
        hinted batch, or `warm_up`)."""
        for signal in self.demand.signals:
            self._split_table(signal)
            for task in (None, *self.demand.tasks):
                self.tables.get(signal, task)
            self.tables.get(signal, None).envelopes

    def warm_up(self) -> None:
        """Build every demand's envelopes now, not inside the first decisions."""
        for task in (None, *self.demand.tasks):
            for signal in self.demand.signals:
                self._demand_of(signal, task).envelopes

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

    def _demand_of(self, signal: str, task: str | None) -> SignalDemand:
        """`signal`'s pass curves under the demand this batch is priced with."""
        return self.tables.get(signal, task, self.mix_for(task))

    def _cdf(self, signal: str, depth: int, task: str | None) -> np.ndarray:
        """The pass probability on the demand grid [21] this batch is priced with."""
        return self._demand_of(signal, task).cdf(depth)

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

    def _split_table(self, signal: str, depths: list[int] | None = None) -> SplitTable:
        """`signal`'s searched splits (built once), or those of the given depths."""
        if depths is None and signal in self._split_tables:
            return self._split_tables[signal]
        depth_pairs = [(d, self.signal_pairs(signal, d)) for d in depths or self.signal_depths(signal)]
        table = SplitTable.of(signal, depth_pairs, self.band_pair(signal), self.profile.num_layers)
        if depths is None:
            self._split_tables[signal] = table
        return table

    def _price(self, shape: BatchShape) -> PassCosts:
        """Every pass kind's seconds for this batch at every column a decision reads."""
        c, q, p, _ = shape.arrays()
        return uniform_costs(self.cost, request_terms(c, q, p).sum(0), self._columns)

    def _search_space(self, signals: tuple[str, ...]) -> SearchSpace:
        if signals not in self._spaces:
            self._spaces[signals] = SearchSpace.of([self._split_table(s) for s in signals])
        return self._spaces[signals]

    def plan(self, requests: list[PlanRequest], budget_s: float) -> BatchPlan:
        start = time.perf_counter()
        if not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise InputError(f"budget_s={budget_s!r} must be a positive number of seconds")
        shape = self.shape(requests)
        task = self.batch_task(requests)
        sized = budget_s / self.margin()  # plans fit this at the mean pace; the monitor targets budget_s
        plans = self._plan_signals(shape, tuple(self.candidate_signals(requests)), sized, task)
        if self.config.signal_rule == "robust" and len(plans) > 1:
            chosen = robust_pick(plans, sized, self.evidence(task), self.config.signal_margin_z, pick)
        else:
            chosen = pick(plans, sized)
        return replace(chosen, budget_s=budget_s, decision_s=time.perf_counter() - start)

    def _plan_signals(self, shape: BatchShape, signals: tuple[str, ...], budget_s: float,
                      task: str | None) -> list[BatchPlan]:
        """Each signal's plan: the batch priced once, each signal's splits walked over the grid and
        the band's coverages, and the signals inside their band searched together."""
        costs, size, pricer = self._price(shape), size_class(shape.num_tokens), RowPricer(self.cost, shape)
        space = self._search_space(signals)
        raws = [costs.walk(table.signal, table.counts) for table in space.tables]  # [J_s, K + 2] each
        bands = [self._band_of(raw, table, size) for raw, table in zip(raws, space.tables)]
        is_in_band = np.array([floor <= budget_s <= saturation for _, floor, saturation in bands])
        found = [None] * len(signals)
        if is_in_band.any():
            paces = space.paces(*zip(*((self.pace_in_class(s, 0, size), self.pace_in_class(s, 1, size))
                                       for s in signals)))  # [J, 1]
            ttft = np.concatenate([raw[:, :NUM_GRID] for raw in raws]) * paces  # [J, K]
            demand = self.tables.searched(signals, task, self.mix_for(task))
            found = search(pricer, space, demand, ttft, paces, budget_s, is_in_band)
        return [self._signal_plan(shape, table.signal, raw[table.band_row, :NUM_GRID], band, budget_s, is_in, found_s,
                                  task)
                for table, raw, band, is_in, found_s in zip(space.tables, raws, bands, is_in_band, found)]

    def _band_of(self, raw: np.ndarray, table: SplitTable, size: int | None) -> tuple[float, float, float]:
        """(pace, floor, saturation) of a signal from its raw walk [J, K + 2]."""
        k = self.pace_in_class(table.signal, self.band_pair(table.signal)[1], size)  # sized for budget / k
        band = raw[table.band_row]
        return k, k * float(band[NUM_GRID]), k * float(band[NUM_GRID + 1])

    def _signal_plan(self, shape: BatchShape, signal: str, band_ttft: np.ndarray, band: tuple[float, float, float],
                     budget_s: float, is_in_band: bool, found: Found | None, task: str | None) -> BatchPlan:
        """The plan of `signal`: static outside its band, else the search's (`found`), else the
        band's split at r_min."""
        k, floor, saturation = band
        if not is_in_band:
            return self._static_plan(shape, signal, band_ttft, k, budget_s, (floor, saturation), task)
        found = found or self._fallback(shape, signal, task)  # nothing fits even at 0%
        (w, p), coverages = found.pair, found.coverages
        return BatchPlan(signal, w, p, coverages, found.ttft_s, found.expected_passes, budget_s, floor, saturation,
                         "planned", task=task)

    def evidence(self, task: str | None) -> EvidenceTable:
        """The demands a batch's signal choice must hold under: the hinted task's, or the served
        mix's and every task's the profile has curves for."""
        mix = self.mix_for(task)
        # a learned mix is the stream's own demand: the tasks' curves it re-weights are not tested apart
        groups = (task,) if task is not None or mix is not None else (None, *self.demand.tasks)
        if groups not in self._num_profiled:
            self._num_profiled[groups] = np.array([self.demand.task_size(t) for t in groups])

        read: dict[int, np.ndarray] = {}  # by plan: the default plan is read once per challenger

        def pass_probabilities(plan: BatchPlan) -> np.ndarray:  # [G, R]
            if id(plan) not in read:
                if mix is not None:
                    cdfs = self._cdf(plan.signal, plan.rank_depth, task)[None, :]
                else:
                    cdfs = self.tables.evidence_cdfs(plan.signal, plan.rank_depth, groups)
                read[id(plan)] = cdfs[:, read_index(plan.coverages)]
            return read[id(plan)]
        return EvidenceTable(self._num_profiled[groups], pass_probabilities)

    def _static_plan(self, shape: BatchShape, signal: str, band_ttft: np.ndarray, k: float, budget_s: float,
                     band: tuple[float, float], task: str | None) -> BatchPlan:
        """Outside the band: the static (S, w, p, r) of the band's split; band_ttft is its raw TTFT
        on the coverage grid [K] and k its pace."""
        (w, p), (floor, saturation), R = self.band_pair(signal), band, shape.num_requests
        if budget_s < floor:
            r, ttft = self.config.r_min, floor
        else:
            r, ttft = self._static_fill(band_ttft, budget_s / k)
            ttft *= k
        passes = float(self._pass_probability(signal, w + p, [r] * R, task).sum())
        return BatchPlan(signal, w, p, (r,) * R, ttft, passes, budget_s, floor, saturation,
                         "below_floor" if budget_s < floor else "above_saturation", task=task)

    def _static_fill(self, ttft: np.ndarray, budget_s: float) -> tuple[float, float]:
        """Above saturation: the static (S, 1, 1, r) plan with the most coverage that fits, from its
        TTFT on the coverage grid [K]. Accuracy converges toward full prefill there under any split
        (paper §5.1), so ranking deeper buys nothing; but budget the scheduler grants past
        saturation still buys coverage."""
        fits = np.nonzero((ttft <= budget_s) & (COVERAGE_GRID >= self.config.r_max))[0]
        k = int(fits.max()) if fits.size else int(np.searchsorted(COVERAGE_GRID, self.config.r_max))
        return float(COVERAGE_GRID[k]), float(ttft[k])

    def _fallback(self, shape: BatchShape, signal: str, task: str | None) -> Found:
        """The band's split at r_min, priced by the layer walk."""
        cov = [self.config.r_min] * shape.num_requests
        w, p = self.band_pair(signal)
        t = float(self.cost.ttft(shape, signal, w, p, np.array(cov))[0]) * self.pace(signal, p, shape.num_tokens)
        return Found((w, p), tuple(cov), t, float(self._pass_probability(signal, w + p, cov, task).sum()))

    def best_splits(self, shape: BatchShape, signal: str, budget_s: float,
                    depths: list[int] | None = None) -> dict[int, tuple[tuple[int, int], float, float]]:
        """Per rank depth: the (w, p) split with the highest feasible uniform coverage, that
        coverage (-1 where none fits) and its TTFT at the learned pace of its family and batch
        size. Ties go to the shallower WarmUp."""
        table = self._split_table(signal, depths)
        space, size = SearchSpace.of([table]), size_class(shape.num_tokens)
        paces = space.paces([self.pace_in_class(signal, 0, size)], [self.pace_in_class(signal, 1, size)])
        ttft = self._price(shape).walk(signal, table.counts)[:, :NUM_GRID] * paces  # [J, K]
        rows, index = best_splits(ttft, space.group_rows, budget_s)
        return {int(d): (table.pairs[j], float(COVERAGE_GRID[k]) if k >= 0 else -1.0,
                         float(ttft[j, k]) if k >= 0 else float("inf"))
                for d, j, k in zip(table.depths, rows.tolist(), index.tolist())}
