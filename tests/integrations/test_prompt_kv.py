"""The vLLM connector's vLLM-free half (`integrations.prompt_kv`) on a tiny random-weight model:
its parameters refused by field, full coverage equal to full prefill's KV, what the report counts,
the plan following the SLO, a rebuild running the plan it is given, a cache salt's namespace
keeping its own chunks, and a store that cannot serve raising (the connector then falls back to
vLLM's prefill)."""
from __future__ import annotations

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.integrations.prompt_kv import ConnectorParams, build_prompt_kv, vllm_request
from cachesmith.model.tokenizer import Tokenizer
from cachesmith.kvstore.keys import namespace_of
from cachesmith.kvstore import ChunkStore, StoreConfig, StoreWriteFailed
from cachesmith.pipeline import RagPipeline
from cachesmith.plan_one import use_profile
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

INST = instance(3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture()
def pipe(tiny_dir, tmp_path):
    pipe = tiny_pipeline(tiny_dir, tmp_path / "kv")
    use_profile(pipe, make_profile(num_layers=pipe.model.num_layers), "synthetic")
    return pipe


def layout(pipe: RagPipeline, docs=INST.documents):
    parts = pipe.prompt(docs, INST.question)
    return parts, {"num_prefix_tokens": len(parts.prefix_ids), "chunk_token_counts": [len(c) for c in parts.chunk_ids]}


def built(pipe, docs=INST.documents, waited_s=0.0, namespace="", plan=None, **extra):
    """(parts, keys, values, the `PromptKV` whose cache they were copied from, now released)."""
    parts, raw = layout(pipe, docs)
    kv = build_prompt_kv(pipe, parts.token_ids, ConnectorParams.parse({**raw, **extra}, len(parts.token_ids)),
                         waited_s, namespace=namespace, plan=plan)
    n = len(parts.token_ids)
    keys, values = kv.cache.key_slab[:, :n].clone(), kv.cache.value_slab[:, :n].clone()
    kv.cache.release()
    return parts, keys, values, kv


def build(pipe, docs=INST.documents, waited_s=0.0, **extra):
    parts, keys, values, kv = built(pipe, docs, waited_s, **extra)
    return parts, keys, values, kv.report


@pytest.mark.parametrize(("change", "field"), [
    (lambda raw: [raw], "must be an object"),
    (lambda raw: {**raw, "chunk_ids": []}, "cachesmith.chunk_ids: unknown field"),
    (lambda raw: {k: v for k, v in raw.items() if k != "chunk_token_counts"}, "chunk_token_counts is required"),
    (lambda raw: {**raw, "num_prefix_tokens": -1}, "num_prefix_tokens=-1"),
    (lambda raw: {**raw, "num_prefix_tokens": True}, "num_prefix_tokens=True"),
    (lambda raw: {**raw, "chunk_token_counts": 5}, "chunk_token_counts must be a list"),
    (lambda raw: {**raw, "chunk_token_counts": [4, 0]}, r"chunk_token_counts\[1\]=0"),
    (lambda raw: {**raw, "method": "bogus"}, "method='bogus'"),
    (lambda raw: {**raw, "method": "cachesmith:qci"}, "method='cachesmith:qci'"),  # a planner ablation: no fixed plan
    (lambda raw: {**raw, "method": 3}, "method=3"),
    (lambda raw: {**raw, "slo_ms": 0}, "slo_ms=0"),
    (lambda raw: {**raw, "slo_ms": float("inf")}, "slo_ms=inf"),
    (lambda raw: {**raw, "slo_ms": "fast"}, "slo_ms='fast'"),
    (lambda raw: {**raw, "chunk_token_counts": [*raw["chunk_token_counts"][:-1], 10_000]}, "at least one question token"),
])
def test_parameters_are_refused_by_field(pipe, change, field):
    parts, raw = layout(pipe)
    with pytest.raises(InputError, match=field):
        ConnectorParams.parse(change(raw), len(parts.token_ids))


def test_the_parameters_split_the_prompt_as_given(pipe):
    parts, raw = layout(pipe)
    params = ConnectorParams.parse(raw, len(parts.token_ids))
    assert params.parts(parts.token_ids) == parts
    # the question may be a single token: the one vLLM computes
    whole = ConnectorParams.parse({**raw, "chunk_token_counts": [*raw["chunk_token_counts"][:-1],
                                                                 raw["chunk_token_counts"][-1] + len(parts.suffix_ids) - 1]},
                                  len(parts.token_ids))
    assert whole.parts(parts.token_ids).suffix_ids == parts.token_ids[-1:]


def test_vllm_request_builds_the_body_the_connector_parses(tiny_dir):
    """One call gives a client the prompt's ids and its layout: the connector splits them back into
    the documents and the question, and refuses nothing."""
    body = vllm_request(INST.documents, INST.question, str(tiny_dir), served_name="tiny", slo_ms=1500,
                        method="cacheblend@0.15", max_tokens=8)
    assert (body["model"], body["max_tokens"]) == ("tiny", 8)
    raw = body["kv_transfer_params"]["cachesmith"]
    params = ConnectorParams.parse(raw, len(body["prompt"]))
    want = Tokenizer(tiny_dir).rag_prompt_parts(INST.documents, INST.question)
    assert params.parts(body["prompt"]) == want and body["prompt"] == want.token_ids
    assert (params.method, params.slo_ms) == ("cacheblend@0.15", 1500)
    with pytest.raises(InputError, match="slo_ms=-5"):
        vllm_request(INST.documents, INST.question, str(tiny_dir), slo_ms=-5)


def test_full_coverage_is_full_prefill_and_the_report_counts_the_store(pipe):
    parts, keys, values, first = build(pipe, method="full_prefill")
    _, cache = pipe.model.prefill(parts.token_ids)
    n = len(parts.token_ids)
    torch.testing.assert_close(keys, cache.key_slab[:, :n], atol=1e-4, rtol=0)
    torch.testing.assert_close(values, cache.value_slab[:, :n], atol=1e-4, rtol=0)
    cache.release()
    num_chunks, context = len(parts.chunk_ids), sum(len(c) for c in parts.chunk_ids)
    assert (first.num_chunks, first.num_chunks_stored, first.num_chunks_prefilled) == (num_chunks, 0, num_chunks)
    assert first.num_recomputed_tokens == context and first.budget_ms is None
    _, _, _, shuffled = build(pipe, INST.documents[::-1], method="full_reuse")  # the same chunks, another order
    assert (shuffled.num_chunks_stored, shuffled.num_chunks_prefilled) == (num_chunks, 0)
    assert shuffled.num_stored_tokens == context and shuffled.num_recomputed_tokens == 0
    assert shuffled.to_params()["cachesmith"]["plan"] == shuffled.plan


def test_the_plan_follows_what_is_left_of_the_slo(pipe):
    parts, _, _, generous = build(pipe, slo_ms=3_600_000)
    _, _, _, late = build(pipe, slo_ms=3_600_000, waited_s=3_600.0)  # its SLO spent waiting: full reuse
    _, _, _, tight = build(pipe, slo_ms=0.001)
    context = sum(len(c) for c in parts.chunk_ids)
    assert generous.num_recomputed_tokens == context and generous.budget_ms > 1000
    assert late.num_recomputed_tokens == tight.num_recomputed_tokens == 0
    assert late.plan.startswith("(position,0,0,") and late.budget_ms < generous.budget_ms


def test_a_rebuild_runs_the_plan_it_is_given(pipe):
    # the first build plans under a generous SLO; a rebuild an hour later would plan full reuse
    _, keys, values, first = built(pipe, slo_ms=3_600_000)
    _, again_keys, again_values, again = built(pipe, slo_ms=3_600_000, waited_s=3_600.0, plan=first.plan)
    _, _, _, replanned = built(pipe, slo_ms=3_600_000, waited_s=3_600.0)
    assert again.plan == first.plan and again.report.plan == first.report.plan
    assert again.report.budget_ms == first.report.budget_ms
    torch.testing.assert_close(again_keys, keys, atol=0, rtol=0)  # the same rows, bit for bit
    torch.testing.assert_close(again_values, values, atol=0, rtol=0)
    assert replanned.report.plan != first.report.plan  # without it, the rows would have changed


def test_a_cache_salt_keeps_its_own_chunks(pipe):
    alice, bob = namespace_of("", "alice"), namespace_of("", "bob")
    parts, keys, _, first = built(pipe, namespace=alice, method="full_reuse")
    _, bob_keys, _, other = built(pipe, namespace=bob, method="full_reuse")
    _, _, _, again = built(pipe, namespace=alice, method="full_reuse")
    _, _, _, unsalted = built(pipe, method="full_reuse")
    num_chunks = len(parts.chunk_ids)
    assert first.report.num_chunks_prefilled == num_chunks
    assert other.report.num_chunks_prefilled == num_chunks  # equal text, but not alice's entries
    assert (again.report.num_chunks_stored, again.report.num_chunks_prefilled) == (num_chunks, 0)
    assert unsalted.report.num_chunks_prefilled == num_chunks
    torch.testing.assert_close(bob_keys, keys, atol=0, rtol=0)  # same text, same KV: only the key differs
    chunk = parts.chunk_ids[0]
    stored = {pipe.store.key_for(pipe.model, chunk, ns) for ns in (alice, bob, "")}
    assert len(stored) == 3 and all(pipe.store.contains(key) for key in stored)


def test_a_store_that_cannot_serve_a_chunk_raises(tiny_dir):
    # a redis-only store whose server is gone keeps nothing: the chunk just prefilled is refused
    store = ChunkStore(StoreConfig(tiers=("redis",), redis_url="redis://127.0.0.1:9/0"))
    pipe = RagPipeline(str(tiny_dir), store=store)
    with pytest.raises(StoreWriteFailed, match="no store tier took its KV"):
        build(pipe, method="cacheblend@0.15")
