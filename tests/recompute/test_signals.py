"""Selection signals checked against direct computations, and the layer-0 QCI entropy."""
from __future__ import annotations

import math

import pytest
import torch

from cachesmith.model import Decoder
from cachesmith.recompute import BatchRunner, RecomputeConfig, Signal
from cachesmith.errors import ConfigError
from cachesmith.recompute.signals import fuse, normalized_entropy
from tests.recompute.helpers import make_request, max_diff


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return Decoder(tiny_llama_dir[0])


def _direct_qci_layer0(model, req):
    """Suffix queries at layer 0 over [cached prefix+chunks, fresh suffix]: explicit softmax, heads
    expanded with repeat_interleave (a different route from the runner's grouped one)."""
    entries = ([req.prefix] if req.prefix is not None else []) + list(req.chunks)
    num_cached = sum(e.num_tokens for e in entries)
    num_prefix = req.prefix.num_tokens if req.prefix is not None else 0
    n = len(req.suffix_ids)
    layer = model.layers[0]
    pos_q = torch.arange(num_cached, num_cached + n)
    with torch.inference_mode():
        q, k, _ = layer.qkv(layer.input_norm(model.embed(torch.tensor(req.suffix_ids))))
        q, k = model.rope.rotate(q, pos_q), model.rope.rotate(k, pos_q)
        cached = model.rope.rotate(torch.cat([e.keys[0] for e in entries]), torch.arange(num_cached))
        keys = torch.cat([cached, k]).repeat_interleave(model.config.num_heads // model.config.num_kv_heads, 1)
        logits = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(model.config.head_dim)
        visible = torch.arange(num_cached + n)[None, :] <= pos_q[:, None]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return probs[:, :, num_prefix:num_cached].sum(dim=(0, 1))


def test_qci_scores_equal_direct_softmax(model):
    req, _ = make_request(model, seed=21)
    out = BatchRunner(model).run([req], RecomputeConfig(Signal.QCI, 0, 1, 0.3))[0]
    assert max_diff(out.scores, _direct_qci_layer0(model, req)) < 1e-5
    assert out.selected.numel() == math.ceil(0.3 * out.num_context)
    top = torch.topk(out.scores, out.selected.numel()).indices
    assert set(top.tolist()) == set(out.selected.tolist())


def test_qci_entropy_after_first_warmup_layer(model):
    req, _ = make_request(model, seed=22)
    out = BatchRunner(model).run([req], RecomputeConfig(Signal.KV_DEV, 1, 0, 0.2))[0]
    assert out.qci_entropy == pytest.approx(normalized_entropy(_direct_qci_layer0(model, req)), abs=1e-6)
    assert 0.0 < out.qci_entropy <= 1.0
    none = BatchRunner(model).run([req], RecomputeConfig(Signal.KV_DEV, 0, 0, 0.2))[0]
    assert none.qci_entropy is None


def test_normalized_entropy_extremes():
    assert normalized_entropy(torch.ones(10)) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0.0, 5.0, 0.0, 0.0])) == pytest.approx(0.0)


def test_kv_dev_scores_deviation_of_fresh_from_cached(model):
    req, flat = make_request(model, seed=23)
    out = BatchRunner(model).run([req], RecomputeConfig(Signal.KV_DEV, 1, 0, 0.25, kv_dev_target="k"))[0]
    # reference: layer-1 pre-RoPE K of full prefill vs each chunk's isolated layer-1 K
    pre_rope: list[torch.Tensor] = []
    model.forward(torch.tensor(flat), pre_rope_keys=pre_rope)
    num_prefix = req.prefix.num_tokens
    fresh = pre_rope[1][num_prefix:num_prefix + out.num_context]
    cached = torch.cat([c.keys[1] for c in req.chunks])
    expected = (fresh - cached).flatten(1).norm(dim=1)
    assert max_diff(out.scores, expected) < 1e-4
    assert out.scores[:req.chunks[0].num_tokens].max() > 0  # the prefix makes chunk 1 deviate too


def test_position_signal_takes_chunk_heads_except_first(model):
    req, _ = make_request(model, seed=24, chunk_lens=(10, 10, 10))
    out = BatchRunner(model).run([req], RecomputeConfig(Signal.POSITION, 0, 0, 0.2))[0]
    assert out.selected.tolist() == [10, 11, 20, 21]
    assert out.scores is None


@pytest.mark.parametrize("coverage", [0.0, 0.05, 0.3, 0.99])
def test_position_selection_and_ranking_follow_each_chunk(model, coverage):
    """Uneven chunks against the definition written per chunk: the first ceil(r * |c|) tokens of
    every chunk but the first."""
    lens = (7, 13, 1, 29, 4)
    req, _ = make_request(model, seed=25, chunk_lens=lens)
    out = BatchRunner(model).run([req], RecomputeConfig(Signal.POSITION, 0, 0, coverage))[0]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    want = [a + j for a, n in list(zip(starts, lens))[1:] for j in range(math.ceil(coverage * n - 1e-9))]
    assert out.selected.tolist() == want


def test_coverage_per_request_sets_selection_size(model):
    reqs = [make_request(model, seed=30 + i, coverage=c)[0] for i, c in enumerate([0.0, 0.5, 1.0])]
    outs = BatchRunner(model).run(reqs, RecomputeConfig(Signal.QCI, 0, 2, 0.1))
    assert [o.selected.numel() for o in outs] == [0, math.ceil(0.5 * 28), 28]


def test_fuse_takes_the_union_of_both_heads_kv_side_first():
    kv = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])  # ranks 0, 1, 2, 3, 4, 5
    qci = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.9, 0.8])  # ranks 4, 5, 3, 2, 0, 1
    scores, order = fuse(kv, qci)
    assert order.tolist() == [0, 4, 1, 5, 2, 3]  # kv#0, q#0, kv#1, q#1, kv#2, q#2
    assert set(order[:4].tolist()) == {0, 1} | {4, 5}  # each signal's top 2
    assert scores.tolist() == pytest.approx([1.0, 5 / 6, 4 / 6, 4 / 6, 1.0, 5 / 6])
    _, same = fuse(kv, kv)  # one signal twice: its own ranking
    assert same.tolist() == [0, 1, 2, 3, 4, 5]


def test_fused_config_needs_a_warmup_layer():
    with pytest.raises(ConfigError, match="warmup=0 must be >= 1 for signal 'fused'"):
        RecomputeConfig(Signal.FUSED, 0, 3, 0.3)
