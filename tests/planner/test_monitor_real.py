"""The runtime monitor keeping a batch inside its budget when layers run late, on the packaged
model (CPU): the runner and monitor run for real while the clock they read is priced by a known
cost model. How well a fit prices this machine's wall time is a benchmark's (`cachesmith profile`
validation, `benchmarks/cost_model.py`); the fit itself is checked on known costs in test_fit.py."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import Decoder, resolve_model
from cachesmith.planner import BatchShape, Planner, PlannerConfig, PlanRequest
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.calibration.synthetic import random_request
from cachesmith.recompute import BatchRunner, HookChain, RecomputeConfig, RunnerHooks
from tests.planner.synthetic_profile import make_profile
from tests.planner.test_monitor import durations

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def profile():
    model = Decoder(resolve_model("smollm2-135m"), "cpu", torch.float32)
    cfg = model.config
    return model, make_profile(model.num_layers, 2 * cfg.num_kv_heads * cfg.head_dim * 4)


class VirtualTime(RunnerHooks):
    """The batch's clock as the cost model prices each pass at the coverages the runner is using
    (the monitor's, lowered as it cuts), plus `delay_s` on every Patch layer from `start` on (a
    slow link). Wall time on a shared 2-core machine moves by more than the overrun under test, so
    the runner and monitor run for real while the clock they read is this one."""

    def __init__(self, planner, plan, shape, start: int, delay_s: float, monitor=None) -> None:
        self.planner, self.plan, self.shape = planner, plan, shape
        self.start, self.delay_s, self.monitor = start, delay_s, monitor
        self.now, self._step = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def after_layer(self, info):
        coverages = self.monitor.coverages if self.monitor else self.plan.coverages
        j, self._step = self._step, self._step + 1
        self.now += float(durations(self.planner, self.plan, self.shape, coverages)[j])
        if info.phase == "patch" and info.layer >= self.start:
            self.now += self.delay_s
        return None


def _run(model, plan, reqs, hooks):
    runner = BatchRunner(model)
    config = RecomputeConfig(plan.signal, plan.warmup, plan.probe, max(plan.coverages))
    for req, cov in zip(reqs, plan.coverages):
        req.coverage = cov
    return runner.run(reqs, config, hooks)


def test_replanning_keeps_the_batch_within_budget_under_a_slowdown(profile):
    """The real runner under the monitor: a slow link on the second half of the layers would end
    the batch past its budget; the monitor cuts coverage, the runner recomputes fewer rows, and the
    batch ends within the budget's tolerance."""
    model, prof = profile
    planner = Planner(prof, PlannerConfig(signal="qci"))  # the band below is QCI's
    contexts = (768, 512)
    plan_reqs = [PlanRequest(c, 32, 0, 0.2) for c in contexts]
    floor, saturation = planner.band(planner.shape(plan_reqs), "qci")
    budget = floor + 0.9 * (saturation - floor)  # coverage to give back when layers run late
    plan = planner.plan(plan_reqs, budget)
    assert plan.status == "planned"
    rng = __import__("random").Random(5)
    reqs = lambda: [random_request(model, [], c, rng)[0] for c in contexts]  # noqa: E731
    shape = BatchShape(contexts, (32, 32), (0, 0))
    # the slowdown adds 20% of the budget over the second half of the layers: more than the plan
    # leaves over, less than the coverage those layers recompute
    half, delay = model.num_layers // 2, 0.2 * budget / (model.num_layers // 2)
    late = VirtualTime(planner, plan, shape, half, delay)
    full = _run(model, plan, reqs(), late)
    clock = VirtualTime(planner, plan, shape, half, delay)
    monitor = RuntimeMonitor(plan, planner.cost, shape, clock=clock)
    clock.monitor = monitor
    monitor.start()
    outs = _run(model, plan, reqs(), HookChain(clock, monitor))
    assert late.now > budget * 1.1  # without the monitor the batch misses its budget
    assert monitor.num_replans >= 1 and clock.now <= budget * (1 + monitor.tolerance), (late.now, clock.now, budget)
    # the runner applied the cuts: fewer rows recomputed than the plan, and fewer than unmonitored
    assert all(o.selected.numel() < c * p for o, c, p in zip(outs, contexts, plan.coverages))
    assert sum(o.selected.numel() for o in outs) < sum(o.selected.numel() for o in full)
