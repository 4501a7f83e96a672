"""The fitted cost model on the packaged model (CPU), timed through the serving path (stored chunk
KV staged by the transfer engine): held-out batch shapes priced within 30% on average, and the runtime
monitor keeping a batch inside its budget when layers run late. The accuracy bar itself is a
benchmark's (`cachesmith profile` validation, `benchmarks/cost_model.py`); here a broken fit (wrong
features, wrong units) must fail, while a shared machine's noise must not."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import Decoder, resolve_model
from cachesmith.planner import BatchShape, CostModel, Planner, PlannerConfig, PlanRequest, Profile
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.profiler.costs import PLANNER_PLANS, PRESET_PLANS, RunSpec, TimingBench, fit_costs, measure, \
    validation_error
from cachesmith.profiler.synthetic import random_request
from cachesmith.recompute import BatchRunner, HookChain, RecomputeConfig, RunnerHooks
from tests.planner.synthetic_profile import make_profile
from tests.planner.test_monitor import durations

pytestmark = pytest.mark.real_model
SHAPES = [(256,), (512,), (1024,), (256, 256), (512, 512)]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    model = Decoder(resolve_model("smollm2-135m"), "cpu", torch.float32)
    bench = TimingBench(model, tmp_path_factory.mktemp("kv"), num_chunks=16, chunk_tokens=(96, 256))
    specs = [RunSpec(s, plan, i) for i, s in enumerate(SHAPES) for plan in PRESET_PLANS + PLANNER_PLANS[:3]]
    cfg = model.config
    kv_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    costs, overhead = fit_costs(measure(bench, specs, show_progress=False), model.num_layers)
    synthetic = make_profile()
    yield model, Profile(model.fingerprint, "smollm2-135m", "float32", "cpu", model.num_layers, kv_bytes, costs,
                         overhead, {"memory": 1e6}, synthetic.demand, 0.6), bench
    bench.close()


def test_held_out_batch_shapes_are_priced_by_the_fit(profile):
    model, prof, bench = profile
    cost = CostModel(prof)

    rows = validation_error(bench, cost, shapes=((384,), (768, 256), (640,)), repeats=3)
    errors = [r["rel_err"] for r in rows]
    # 30% on average, 50% at most: the same run measured a 19% mean after other tests had run in the
    # process and under 15% alone (2 shared cores); a fit in wrong units or missing a layer kind
    # is off by far more
    assert sum(errors) / len(errors) < 0.30 and max(errors) < 0.50, rows


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
    model, prof, _ = profile
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
