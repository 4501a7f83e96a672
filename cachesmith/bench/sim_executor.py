"""The simulator's runtime (the `simulate` clock): the Engine's executor with no model. A batch
takes the cost model's TTFT (transfer over the simulated link included) on this machine's measured
pace, and each request's gate verdict is read from the outcome tables under the plan it ran.

In: a `ScheduleDecision` and the `Request`s it names, each the simulated request of an
`Outcome` (token counts, QCI entropy, verdicts): `request` makes one and notes its outcome. The
machine is the profile's costs at each plan family's pace plus the reuse time per placed cached
row (`bench.pace.MachinePace`). Out:
`BatchExecution` (seconds, stall, plan, verdicts) and `RequestOutput`s with `is_passed` set.
"Planned" batches ask the same `Planner` the engine uses, from the tables' layer-0 entropies (the
planner's decision time is real and counted), and run under the same `RuntimeMonitor`, driven on
the batch's virtual time: when the machine runs behind the plan, the monitor lowers the remaining
Patch layers' coverage as it does on the real runner, and the verdicts are read at the coverage the
batch ended with.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.executor import BatchExecution, RequestOutput, TokenHook, queued_view
from cachesmith.planner import BatchPlan, BatchShape, CostModel, Planner, PlanRequest
from cachesmith.planner.cost_model import Step
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.recompute import RecomputeConfig
from cachesmith.recompute.hooks import LayerInfo
from cachesmith.request import Request, check_fits, check_slo
from cachesmith.scheduler import QueuedRequest, ScheduleDecision
from cachesmith.scoring import Expected
from cachesmith.scheduler.types import batch_shape
from cachesmith.bench.outcomes import Outcome, OutcomeTable
from cachesmith.bench.pace import MachinePace, family

INFINITE_GBPS = 1e9  # a link that never stalls: what compute alone takes


@dataclass(frozen=True)
class MachineNoise:
    """A shared machine's wandering pace: batch n runs at exp(x_n) x its time, x an AR(1) over the
    batches with stationary std `sigma` and lag-one correlation `corr` (slow minutes come in
    runs: replays on shared 2-core machines drifted 1.3-1.6x within an hour and swung 0.5-3.6x
    batch to batch). The median factor is 1."""
    sigma: float = 0.0
    corr: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.sigma <= 1:
            raise ConfigError(f"noise sigma={self.sigma} must be in [0, 1]")
        if not 0 <= self.corr < 1:
            raise ConfigError(f"noise corr={self.corr} must be in [0, 1)")

    def factors(self):
        """An endless stream of per-batch slowdown factors."""
        rng = np.random.default_rng(self.seed)
        x = self.sigma * rng.standard_normal()
        while True:
            yield float(np.exp(x))
            x = self.corr * x + self.sigma * np.sqrt(1 - self.corr ** 2) * rng.standard_normal()


class SimExecutor:
    """`machine`: this machine's pace per plan family and reuse cost (`bench.pace`); a plain
    {family: pace} dict is taken too. Without one the batches run at the profile's speed.
    `decision_s`: each plan decision costs this much virtual time; None: its measured wall time
    (the shipped planner on this machine, which makes two runs of one setting differ slightly)."""

    def __init__(self, table: OutcomeTable, planner: Planner, link: CostModel,
                 machine: MachinePace | dict | None = None, noise: MachineNoise | None = None,
                 decision_s: float | None = None) -> None:
        self.table, self.planner, self.link, self.decision_s = table, planner, link, decision_s
        self.pace = machine if isinstance(machine, MachinePace) else MachinePace.from_dict(machine)
        self._slowdowns = (noise or MachineNoise()).factors()
        self._machines: dict[str, tuple[CostModel, CostModel]] = {}
        self.outcomes: dict[int, Outcome] = {}  # the measured outcome behind each request id

    def request(self, request_id: int, outcome: Outcome, slo_s: float, arrival_s: float = 0.0) -> Request:
        """The simulated request of `outcome`: no stored prompt (its token counts are the
        outcome's), gated by the outcome's verdicts. A simulated request enters here: its SLO and
        positions are checked here, once (`InputError`)."""
        check_slo(slo_s, f"request {request_id}: slo_s")
        check_fits(outcome.num_tokens, outcome.max_new_tokens, self.table.max_positions, f"request {request_id}")
        self.outcomes[request_id] = outcome
        return Request(request_id, None, slo_s, outcome.max_new_tokens, arrival_s, expected=Expected(outcome.task))

    def machine(self, signal: str, warmup: int, probe: int, num_tokens: int = 0) -> tuple[CostModel, CostModel]:
        """(the simulated machine for this plan family and batch size in prompt tokens over the
        link, the same with no link limit); the link is not paced."""
        fam = family(signal, warmup, probe)
        key = self.pace.key(fam, num_tokens)
        if key not in self._machines:
            paced = CostModel(self.pace.profile(self.link.profile, fam, num_tokens), self.link.bandwidth_gbps)
            self._machines[key] = (paced, paced.with_bandwidth(INFINITE_GBPS))
        return self._machines[key]

    def admit(self, request: Request, kv_capacity_tokens: int | None = None,
              view: QueuedRequest | None = None) -> QueuedRequest:
        """The scheduler's view of a simulated request: its outcome's token counts (measured on the
        model, so within its positions), or an `InputError` past the KV capacity."""
        o = self.outcomes[request.request_id]
        return queued_view(request, o.prefix_tokens, o.context_tokens, o.suffix_tokens, kv_capacity_tokens, view)

    def prefill(self, decision: ScheduleDecision, batch: list[Request]) -> BatchExecution:
        views = [self.admit(r) for r in batch]
        shape = batch_shape(views)
        slowdown = next(self._slowdowns)
        if decision.mode != "planned":
            config = replace(decision.static_plan, coverage=decision.coverage)
            coverages = [decision.coverage] * len(batch)
            seconds, stall = (slowdown * t for t in self._ttft(shape, config, np.array([coverages])))
            final, plan, replans = coverages, None, 0
        else:
            reqs = [PlanRequest(q.context_tokens, q.suffix_tokens, q.prefix_tokens,
                                self.outcomes[r.request_id].entropy, r.task) for q, r in zip(views, batch)]
            plan = self.planner.plan(reqs, decision.budget_s)
            if self.decision_s is not None:
                plan = replace(plan, decision_s=self.decision_s)
            config, coverages = plan.recompute_config(), list(plan.coverages)
            seconds, stall, final, replans = self._monitored(plan, shape, decision.limit_s, slowdown)
        signal, w, p = config.signal.value, config.warmup, config.probe
        verdicts = [self.table.passes(self.outcomes[r.request_id], signal, w, p, c)
                    for r, c in zip(batch, final)]
        return BatchExecution([], coverages, seconds, stall, config.label(), plan, replans, verdicts,
                              [float(c) for c in final])

    def _ttft(self, shape: BatchShape, config: RecomputeConfig, cov: np.ndarray) -> tuple[float, float]:
        """(TTFT, transfer stall) of a plan run as planned on the simulated machine."""
        signal, w, p = config.signal.value, config.warmup, config.probe
        machine, compute_only = self.machine(signal, w, p, int(shape.arrays()[3].sum()))
        seconds = float(machine.ttft(shape, signal, w, p, cov)[0])
        return seconds, max(0.0, seconds - float(compute_only.ttft(shape, signal, w, p, cov)[0]))

    def _monitored(self, plan: BatchPlan, shape: BatchShape, limit_s: float | None = None,
                   slowdown: float = 1.0) -> tuple[float, float, list[float], int]:
        """(TTFT, stall, coverages at the end, monitor replans) of a planned batch: layer 0, the
        planner's decision, then the remaining passes one by one under the runtime monitor, on
        virtual time; a lowered coverage reprices the passes still to run. The planner learns the
        pace the monitor saw, as the real executor's does."""
        signal, w, p = plan.signal, plan.warmup, plan.probe
        machines = self.machine(signal, w, p, int(shape.arrays()[3].sum()))
        now = [0.0]
        monitor = RuntimeMonitor(plan, self.planner.cost, shape, steps_done=1, clock=lambda: now[0],
                                 time_scale=self.planner.pace(signal, p, shape.num_tokens), limit_s=limit_s)
        monitor.start(at=0.0)
        cov = np.array(plan.coverages, float)  # [R]
        steps, durations = self._durations(machines, shape, plan, cov, slowdown)  # [2, num_steps]
        t = durations[:, 0] + plan.decision_s  # the plan is made after layer 0, as on the runner
        for j in range(1, len(steps)):
            now[0] = t[0]
            monitor.before_layer(steps[j].layer, _phase(steps[j], w))
            t = t + durations[:, j]
            now[0] = t[0]
            lowered = monitor.after_layer(LayerInfo(steps[j].layer, _phase(steps[j], w), 0, 0))
            if lowered:
                cov = np.array([lowered.get(i, c) for i, c in enumerate(cov)])
                durations[:, j + 1:] = self._durations(machines, shape, plan, cov, slowdown)[1][:, j + 1:]
        if monitor.pace is not None:
            self.planner.observe(signal, monitor.time_scale * monitor.pace, p, shape.num_tokens)
        return float(t[0]), max(0.0, float(t[0] - t[1])), cov.tolist(), monitor.num_replans

    @staticmethod
    def _durations(machines: tuple[CostModel, CostModel], shape: BatchShape, plan: BatchPlan,
                   cov: np.ndarray, slowdown: float = 1.0) -> tuple[list[Step], np.ndarray]:
        """(steps, each pass's time [2, num_steps] over the link and with compute alone, at the
        batch's `slowdown`)."""
        out = []
        for m in machines:
            steps, ends = m.schedule(shape, plan.signal, plan.warmup, plan.probe, cov[None, :])
            out.append(np.diff(ends[:, 0], prepend=0.0))
        return steps, slowdown * np.array(out)

    def decode(self, batch: list[Request], run: BatchExecution,
               on_token: TokenHook | None = None) -> list[RequestOutput]:
        """No tokens: each request's planned coverage, recomputed count (at the coverage it ended
        with) and verdict."""
        out = []
        final = run.final_coverages or run.coverages
        for r, cov, end, verdict in zip(batch, run.coverages, final, run.verdicts):
            o = self.outcomes[r.request_id]
            out.append(RequestOutput("", float(cov), o.context_tokens, int(round(end * o.context_tokens)),
                                     o.entropy, o.num_tokens, 0, verdict))
        return out


def _phase(step: Step, warmup: int) -> str:
    """The runner's name for a pass (what the monitor's hooks are told)."""
    if step.kind in ("patch", "score_patch"):
        return "patch"
    return "warmup" if step.layer < warmup else "probe"
