"""A forked batch (ranked once, patched at many coverages) equals separate runs bit for bit."""
from __future__ import annotations

import pytest
import torch

from cachesmith.errors import ConfigError, InputError
from cachesmith.model import Decoder
from cachesmith.recompute import BatchRunner, RecomputeConfig, Signal, full_prefill
from cachesmith.recompute.fork import PatchFork
from tests.recompute.helpers import make_request

PLANS = [RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3), RecomputeConfig(Signal.KV_DEV, 1, 1, 0.3),
         RecomputeConfig(Signal.QCI, 1, 1, 0.3),
         RecomputeConfig(Signal.QCI, 2, 1, 0.3), RecomputeConfig(Signal.QCI_LAST, 0, 3, 0.3),
         RecomputeConfig(Signal.POSITION, 0, 0, 0.3)]
# run in this order on one fork: a later run must not see an earlier one's patched rows
COVERAGES = [[0.8, 0.15], [0.0, 1.0], [0.35, 0.35], [0.8, 0.15]]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Decoder(tiny_model_dir[0])


def _requests(model):
    return [make_request(model, seed=50, chunk_lens=(9, 12, 7))[0],
            make_request(model, seed=51, chunk_lens=(5, 6, 7, 8), prefix_len=0, suffix_len=4)[0]]


def _assert_same(got, want, model) -> None:
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.selected, want.selected)
    assert got.qci_entropy == want.qci_entropy
    for layer in range(model.num_layers):
        for a, b in zip(got.cache.view(layer), want.cache.view(layer)):
            assert torch.equal(a, b), f"layer {layer}"


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_fork_equals_separate_runs(model, plan):
    runner = BatchRunner(model)
    fork = runner.fork(_requests(model), plan)
    for coverages in COVERAGES:
        reqs = _requests(model)
        for req, c in zip(reqs, coverages):
            req.coverage = c
        want = runner.run(reqs, plan)
        got = fork.run(coverages)
        assert [g.selected.numel() for g in got] == [w.selected.numel() for w in want]
        for g, w in zip(got, want):
            _assert_same(g, w, model)


def test_fork_runs_differ_by_coverage(model):
    # the identity above would hold for a fork that ignored the coverage if the runs did too
    fork = BatchRunner(model).fork(_requests(model), RecomputeConfig(Signal.KV_DEV, 1, 1, 0.3))
    low, high = fork.run([0.1, 0.1]), fork.run([0.9, 0.9])
    assert low[0].selected.numel() < high[0].selected.numel()
    assert not torch.equal(low[0].logits, high[0].logits)


def test_fork_refuses_plans_without_patch_and_bad_coverages(model):
    runner = BatchRunner(model)
    L = model.num_layers
    with pytest.raises(ConfigError, match="no Patch phase"):  # kv_dev's probe layer is a full layer
        runner.fork(_requests(model), RecomputeConfig(Signal.KV_DEV, L - 1, 1, 0.3))
    qci = RecomputeConfig(Signal.QCI, L - 1, 1, 0.3)  # its probe rewinds: the last layer is Patch
    assert qci.has_patch(L) and len(runner.fork(_requests(model), qci).run([0.3, 0.3])) == 2
    fork = runner.fork(_requests(model), RecomputeConfig(Signal.QCI, 1, 1, 0.3))
    with pytest.raises(InputError, match="1 given for 2 requests"):
        fork.run([0.2])
    with pytest.raises(ConfigError, match=r"coverages\[1\]=1.5"):
        fork.run([0.2, 1.5])


def test_forks_sharing_one_warmup_walk_equal_separate_runs(model):
    """`fork_many` walks WarmUp once (depths 0, 1 and 2 here) and branches each plan off it."""
    runner = BatchRunner(model)
    forks = runner.fork_many(_requests(model), PLANS)
    for coverages in COVERAGES[:2]:
        _assert_forks_equal_runs(runner, forks, coverages, model)


def _assert_forks_equal_runs(runner, forks, coverages, model) -> None:
    for plan, fork in zip(PLANS, forks):
        reqs = _requests(model)
        for req, c in zip(reqs, coverages):
            req.coverage = c
        for g, w in zip(fork.run(coverages), runner.run(reqs, plan)):
            _assert_same(g, w, model)


def test_full_prefill_walk_gives_full_prefill_and_the_forks(model):
    """`fork_with_full_prefill`: full prefill goes on past every branch to the last layer and equals
    its own run bit for bit, and the forks branched off it equal separate runs."""
    runner = BatchRunner(model)
    forks, fulls = runner.fork_with_full_prefill(_requests(model), PLANS)
    full = full_prefill(model.num_layers)
    for g, w in zip(fulls, runner.run(_requests(model), full)):
        _assert_same(g, w, model)
    assert not torch.equal(fulls[0].logits, forks[0].run([0.3, 0.3])[0].logits)  # a patch is not full prefill
    _assert_forks_equal_runs(runner, forks, COVERAGES[0], model)
    _, alone = runner.fork_with_full_prefill(_requests(model), [])  # no fork asked: full prefill only
    for g, w in zip(alone, fulls):
        _assert_same(g, w, model)


@pytest.mark.parametrize("plan", PLANS[:4], ids=lambda p: p.label())
def test_forks_patched_together_equal_each_alone(model, plan):
    """Two requests' forks in one Patch batch: the same selections, and logits and caches equal to
    each patched alone up to the float rounding of a larger matrix product."""
    runner = BatchRunner(model)
    a, b = (runner.fork([r], plan) for r in _requests(model))
    together = PatchFork.run_together([a, b, a], [[0.3], [0.6], [0.9]])
    for got, (fork, c) in zip(together, [(a, 0.3), (b, 0.6), (a, 0.9)]):
        want = fork.run([c])[0]
        assert torch.equal(got[0].selected, want.selected)
        assert torch.allclose(got[0].logits, want.logits, atol=1e-4)
        for layer in range(model.num_layers):
            for x, y in zip(got[0].cache.view(layer), want.cache.view(layer)):
                assert torch.allclose(x, y, atol=1e-4), f"layer {layer}"
    other = RecomputeConfig(Signal.QCI, 1 if a.ranked.patch_start == 2 else 2, 1, 0.3)  # another first Patch layer
    with pytest.raises(ConfigError, match="one first Patch layer"):
        PatchFork.run_together([a, runner.fork(_requests(model)[:1], other)], [[0.3], [0.3]])
