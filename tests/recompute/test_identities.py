"""The exact identities of the (S, w, p, r) semantics on tiny random models (float32, 1e-4)."""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder, greedy_decode
from cachesmith.recompute import BatchRunner, RecomputeConfig, Signal, preset
from tests.recompute.helpers import make_request, max_diff, reference_full_reuse

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Decoder(tiny_model_dir[0])


def _full_plans(num_layers):
    return [
        RecomputeConfig(Signal.KV_DEV, 1, 0, 1.0),
        RecomputeConfig(Signal.KV_DEV, 0, 0, 1.0),
        RecomputeConfig(Signal.KV_DEV, 1, 1, 1.0),
        RecomputeConfig(Signal.QCI, 0, num_layers, 1.0),  # the probe rewinds to 0: it must leave no trace
        RecomputeConfig(Signal.QCI, 1, 2, 1.0),
        RecomputeConfig(Signal.QCI_LAST, 0, num_layers, 1.0),
        RecomputeConfig(Signal.POSITION, 0, 0, 1.0),
        RecomputeConfig(Signal.POSITION, 2, 0, 1.0),
    ]


@pytest.mark.parametrize("plan_index", range(8))
def test_full_coverage_equals_full_prefill(model, plan_index):
    plan = _full_plans(model.num_layers)[plan_index]
    req, flat = make_request(model, seed=plan_index)
    ref_logits, ref_cache = model.prefill(flat)
    out = BatchRunner(model).run([req], plan)[0]
    assert max_diff(out.logits, ref_logits) < TOL
    for layer in range(model.num_layers):
        assert max_diff(out.cache.view(layer)[0], ref_cache.view(layer)[0]) < TOL
        assert max_diff(out.cache.view(layer)[1], ref_cache.view(layer)[1]) < TOL
    assert out.selected.numel() == out.num_context


@pytest.mark.parametrize("probe", [0, 2])
def test_warmup_through_all_layers_equals_full_prefill(model, probe):
    req, flat = make_request(model, seed=11)
    ref_logits, _ = model.prefill(flat)
    L = model.num_layers
    for plan in (RecomputeConfig(Signal.QCI, L, 0, 0.1), RecomputeConfig(Signal.KV_DEV, L - probe, probe, 0.0),
                 preset("full_prefill", 0.0, L)):
        out = BatchRunner(model).run([req], plan)[0]
        assert max_diff(out.logits, ref_logits) < TOL


# fused needs a WarmUp layer (its KV deviation at layer 0 would be empty), so it cannot be full reuse
@pytest.mark.parametrize("signal", [s for s in Signal if s is not Signal.FUSED])
def test_zero_coverage_equals_full_reuse(model, signal):
    req, _ = make_request(model, seed=3)
    probe = 0 if signal in (Signal.POSITION, Signal.KV_DEV) else 1
    out = BatchRunner(model).run([req], RecomputeConfig(signal, 0, probe, 0.0))[0]
    assert out.selected.numel() == 0
    assert max_diff(out.logits, reference_full_reuse(model, req)) < TOL


def test_one_chunk_without_prefix_loses_nothing_under_full_reuse(model):
    req, flat = make_request(model, seed=5, chunk_lens=(20,), prefix_len=0)
    ref_logits, _ = model.prefill(flat)
    out = BatchRunner(model).run([req], preset("full_reuse", 0.0, model.num_layers))[0]
    assert max_diff(out.logits, ref_logits) < TOL


def test_full_reuse_with_several_chunks_differs_from_full_prefill(model):
    """Guards the identities above against a runner that silently recomputes everything."""
    req, flat = make_request(model, seed=6)
    ref_logits, _ = model.prefill(flat)
    out = BatchRunner(model).run([req], preset("full_reuse", 0.0, model.num_layers))[0]
    assert max_diff(out.logits, ref_logits) > 1e-3


def test_decode_after_full_coverage_matches_decode_after_full_prefill(model):
    req, flat = make_request(model, seed=8)
    req.extra_capacity = 8
    ref_logits, ref_cache = model.prefill(flat, extra_capacity=8)
    expected = greedy_decode(model, ref_logits, ref_cache, 8, eos_token_ids=())
    out = BatchRunner(model).run([req], preset("cacheblend", 1.0, model.num_layers))[0]
    assert greedy_decode(model, out.logits, out.cache, 8, eos_token_ids=()) == expected


NO_CONTEXT_PLANS = [RecomputeConfig(Signal.KV_DEV, 1, 0, 0.3), RecomputeConfig(Signal.KV_DEV, 1, 1, 0.0),
                    RecomputeConfig(Signal.QCI, 1, 1, 0.5), RecomputeConfig(Signal.QCI_LAST, 0, 3, 0.15),
                    RecomputeConfig(Signal.FUSED, 1, 2, 0.15), RecomputeConfig(Signal.POSITION, 0, 0, 0.0)]


@pytest.mark.parametrize("prefix_len", [5, 0], ids=["prefix", "no-prefix"])
@pytest.mark.parametrize("plan", NO_CONTEXT_PLANS, ids=lambda p: p.label())
def test_a_request_without_context_equals_full_prefill_under_any_plan(model, plan, prefix_len):
    """A plain chat (no documents): only the exact prefix is cached and the suffix is computed, so
    every plan, at any coverage, is full prefill, and a batch mixing it with a RAG request keeps both."""
    req, flat = make_request(model, seed=70 + prefix_len, chunk_lens=(), prefix_len=prefix_len)
    ref_logits, ref_cache = model.prefill(flat)
    rag, _ = make_request(model, seed=71)
    out, other = BatchRunner(model).run([req, rag], plan)
    assert out.num_context == 0 and out.selected.numel() == 0
    assert max_diff(out.logits, ref_logits) < TOL
    for layer in range(model.num_layers):
        for got, want in zip(out.cache.view(layer), ref_cache.view(layer)):
            assert max_diff(got, want) < TOL
    alone = BatchRunner(model).run([make_request(model, seed=71)[0]], plan)[0]
    assert max_diff(other.logits, alone.logits) < TOL
