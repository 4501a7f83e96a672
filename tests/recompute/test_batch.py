"""A heterogeneous batch gives what its requests give alone; hooks see every layer pass."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import Decoder
from cachesmith.recompute import (BatchRunner, HookChain, LayerStatsRecorder, RecomputeConfig,
                                  RunnerHooks, Signal)
from cachesmith.recompute.sequence import build_sequence, fill_cached_rows, stitch_cached_rows
from tests.recompute.helpers import make_request, max_diff

PLANS = [RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3), RecomputeConfig(Signal.KV_DEV, 1, 1, 0.3),
         RecomputeConfig(Signal.QCI, 1, 1, 0.3), RecomputeConfig(Signal.QCI_LAST, 0, 3, 0.3),
         RecomputeConfig(Signal.POSITION, 0, 0, 0.3), RecomputeConfig(Signal.QCI, 3, 0, 0.3)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Decoder(tiny_model_dir[0])


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_batch_equals_requests_alone(model, plan):
    reqs = [
        make_request(model, seed=40, chunk_lens=(9, 12, 7), coverage=0.2)[0],
        make_request(model, seed=41, chunk_lens=(25,), prefix_len=0, suffix_len=3)[0],
        make_request(model, seed=42, chunk_lens=(5, 6, 7, 8, 9), suffix_len=9, coverage=0.6)[0],
    ]
    runner = BatchRunner(model)
    batch = runner.run(reqs, plan)
    for req, got in zip(reqs, batch):
        alone = runner.run([req], plan)[0]
        assert max_diff(got.logits, alone.logits) < 1e-5
        assert torch.equal(got.selected, alone.selected)
        for layer in range(model.num_layers):
            assert max_diff(got.cache.view(layer)[0], alone.cache.view(layer)[0]) < 1e-5


class _Lowering(RunnerHooks):
    def __init__(self, at_layer: int):
        self.at_layer = at_layer

    def after_layer(self, info):
        return {0: 0.0} if info.phase == "patch" and info.layer == self.at_layer else None


def test_hooks_see_phases_and_monitor_can_lower_coverage(model):
    req, _ = make_request(model, seed=50)
    recorder = LayerStatsRecorder()
    plan = RecomputeConfig(Signal.QCI, 1, 1, 0.5)
    out = BatchRunner(model).run([req], plan, HookChain(recorder, _Lowering(at_layer=1)))[0]
    phases = [(s.layer, s.phase) for s in recorder.stats]
    assert phases == [(0, "warmup"), (1, "probe")] + [(i, "patch") for i in range(1, model.num_layers)]
    patch = [s for s in recorder.stats if s.phase == "patch"]
    assert patch[0].num_computed_tokens == 14 + 6 and patch[1].num_computed_tokens == 6
    assert patch[1].kv_bytes_read > patch[0].kv_bytes_read > 0
    assert recorder.stats[0].kv_bytes_read == 0 and all(s.seconds > 0 for s in recorder.stats)
    assert out.selected.numel() == 0
    # after lowering, every cached row of the later layers holds the reused KV, bit for bit
    scratch = build_sequence(model, req, 0.0, 0)
    stitch_cached_rows(model, scratch)
    num_cached = fill_cached_rows(model, scratch, 2)
    assert max_diff(out.cache.view(2)[0][:num_cached], scratch.cache.view(2, num_cached)[0]) == 0.0
    assert out.cache.num_tokens == num_cached + len(req.suffix_ids)


class _Tracer(RunnerHooks):
    def __init__(self):
        self.events = []

    def before_layer(self, layer, phase):
        self.events.append(("before", layer, phase))

    def after_layer(self, info):
        self.events.append(("after", info.layer, info.phase))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_every_layer_pass_is_bracketed_by_both_hooks(model, plan):
    req, _ = make_request(model, seed=60)
    tracer = _Tracer()
    BatchRunner(model).run([req], plan, tracer)
    events = tracer.events
    assert [e[0] for e in events] == ["before", "after"] * (len(events) // 2)
    assert all(b[1:] == a[1:] for b, a in zip(events[::2], events[1::2]))
    patched = [e[1] for e in events[::2] if e[2] == "patch"]
    start = plan.warmup + plan.probe if plan.signal is Signal.KV_DEV else plan.warmup
    assert patched == list(range(start, model.num_layers))


@pytest.mark.parametrize("final", [RecomputeConfig(Signal.QCI, 2, 1, 0.3), RecomputeConfig(Signal.KV_DEV, 1, 1, 0.5),
                                   RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3),
                                   RecomputeConfig(Signal.QCI, 1, 2, 0.4)], ids=lambda p: p.label())
def test_plan_decided_after_layer_0_equals_that_plan_from_the_start(model, final):
    """The planner picks the signal from layer-0 entropies; layer 0 is the same full layer under
    every plan with w >= 1, so deciding there loses nothing."""
    def requests(coverages=(None, None)):
        return [make_request(model, seed=50, chunk_lens=(9, 12, 7), coverage=coverages[0])[0],
                make_request(model, seed=51, chunk_lens=(14, 6), coverage=coverages[1])[0]]

    seen = []

    def replan(entropies):
        seen.append(entropies)
        return final, [0.2, None]

    runner = BatchRunner(model)
    provisional = RecomputeConfig(Signal.POSITION, 1, 0, 0.0)
    got = runner.run(requests(), provisional, replan=replan)
    want = runner.run(requests((0.2, None)), final)
    assert len(seen) == 1 and all(0.0 <= h <= 1.0 for h in seen[0])
    for a, b in zip(got, want):
        assert max_diff(a.logits, b.logits) < 1e-5 and torch.equal(a.selected, b.selected)


def test_replan_to_a_plan_without_warmup_is_refused(model):
    with pytest.raises(Exception, match="warmup >= 1"):
        BatchRunner(model).run([make_request(model, seed=52)[0]], RecomputeConfig(Signal.POSITION, 1, 0, 0.0),
                               replan=lambda h: (RecomputeConfig(Signal.QCI, 0, 2, 0.3), None))
