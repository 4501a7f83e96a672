"""`Request` and `RagPipeline.request`: what the engine needs of a request, built from the user's
own texts, and the rules every request obeys, checked in one place."""
from __future__ import annotations

import math

import pytest

from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import InputError
from cachesmith.model.sampling import GREEDY
from cachesmith.recompute import full_prefill
from cachesmith.kvstore import StoredEntry, StoredPrompt
from cachesmith.request import Request, check_fits, check_max_tokens, check_slo
from cachesmith.scoring import Expected
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return tiny_pipeline(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")), tmp_path_factory.mktemp("kv"))


def test_the_slo_rule_names_the_field_in_its_own_unit():
    check_slo(0.5)
    check_slo(3600.0, max_slo_s=3600.0)
    for bad in (0.0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(InputError, match="slo_s=.*must be a positive number"):
            check_slo(bad)
    with pytest.raises(InputError, match="slo_ms=4000000.0: must be a positive number and at most 3600000"):
        check_slo(4_000_000.0, "slo_ms", 3600.0, scale=1e3)
    with pytest.raises(InputError, match="slo_ms=0.5: must be a positive number of at least 1 and at most"):
        check_slo(0.5, "slo_ms", 3600.0, 1e-3, scale=1e3)
    check_slo(1.0, "slo_ms", 3600.0, 1e-3, scale=1e3)


def test_the_positions_rule_counts_the_tokens_to_generate():
    check_fits(1000, 24, 1024, "documents")
    with pytest.raises(InputError, match="documents: the prompt's 1001 tokens \\+ max_new_tokens 24 exceed the "
                                         "model's 1024 positions"):
        check_fits(1001, 24, 1024, "documents")


def test_the_token_budget_rule_names_the_field_and_its_limit():
    check_max_tokens(1)
    check_max_tokens(512, "max_tokens", 512)
    for bad in (0, -3, 1.5, True, "4"):
        with pytest.raises(InputError, match="max_new_tokens=.*must be an integer >= 1"):
            check_max_tokens(bad)
    with pytest.raises(InputError, match="max_tokens=513: must be an integer between 1 and 512"):
        check_max_tokens(513, "max_tokens", 512)


def test_a_request_counts_its_prompt_from_its_stored_entries():
    prompt = StoredPrompt((StoredEntry("a" * 64, 5), StoredEntry("b" * 64, 4, (9,) * 4, "ns", False)), (1, 2),
                          StoredEntry("c" * 64, 3))
    req = Request(7, prompt, 2.0, 3, 1.5)
    assert (req.task, req.expected.gold, req.sampling) == ("custom", (), GREEDY)
    assert (prompt.num_tokens, prompt.num_prefix_tokens, prompt.num_context_tokens) == (14, 3, 9)
    assert prompt.chunk_keys == ("a" * 64, "b" * 64) and prompt.chunk_num_tokens == (5, 4)
    assert prompt.was_stored == (True, False) and prompt.prefix_key == "c" * 64
    assert [name for name, _ in prompt.entries()] == ["prefix", "chunks[0]", "chunks[1]"]


@pytest.mark.real_model
def test_the_pipelines_request_checks_each_rule_where_the_values_enter(pipe):
    with pytest.raises(InputError, match="request 7: slo_s=-1.0"):
        pipe.request(7, ["text"], "q", -1.0)
    with pytest.raises(InputError, match="request 7: max_new_tokens=0"):
        pipe.request(7, ["text"], "q", 1.0, max_new_tokens=0)


@pytest.mark.real_model  # the tiny model borrows the packaged model's tokenizer
def test_the_pipeline_stores_a_request_of_texts_before_it_is_queued(pipe):
    docs = ("First text about lanterns.", "Second text about harbours.")
    req = pipe.request(7, docs, "What?", 2.0, arrival_s=1.5, max_new_tokens=3, system="Be brief.",
                       answer_prefix="Answer:")
    parts = pipe.prompt(docs, "What?", "Answer:", "Be brief.")
    prompt = req.prompt
    assert prompt.chunk_keys == tuple(pipe.store.key_for(pipe.model, ids) for ids in parts.chunk_ids)
    assert all(pipe.store.contains(k) for k in (*prompt.chunk_keys, prompt.prefix_key))
    assert prompt.chunk_num_tokens == tuple(map(len, parts.chunk_ids)) and prompt.suffix_ids == tuple(parts.suffix_ids)
    assert (req.request_id, req.slo_s, req.arrival_s, req.max_new_tokens, req.expected) == (7, 2.0, 1.5, 3, Expected())


@pytest.mark.real_model
def test_the_pipelines_request_errors_name_the_field(pipe):
    with pytest.raises(InputError, match="request 3: documents"):
        pipe.request(3, "one text, not a list of them", "q", 1.0)
    with pytest.raises(InputError, match="documents"):
        pipe.request(3, ["fine", "  "], "q", 1.0)
    with pytest.raises(InputError, match="question"):
        pipe.request(3, ["fine"], " ", 1.0)
    with pytest.raises(InputError, match="request 3: the prompt's .* exceed the model's 1024 positions"):
        pipe.request(3, ["word " * 400, "word " * 400], "q", 1.0, max_new_tokens=400)


@pytest.mark.real_model
def test_a_request_of_texts_runs_through_the_engine_like_the_pipeline(pipe):
    reqs = [pipe.request(i, instance(i).documents, instance(i).question, 5.0, arrival_s=0.05 * i, max_new_tokens=3)
            for i in range(3)]
    eng = Engine(pipe, make_profile(num_layers=pipe.model.num_layers), EngineConfig("full_prefill", "replay"))
    results = eng.run(reqs)
    plan = full_prefill(pipe.model.num_layers)
    for i, res in enumerate(results):
        ref = pipe.answer(instance(i).documents, instance(i).question, plan, 3)
        assert res.error is None and res.answer == ref.text
        assert res.task == "custom" and res.is_passed is None  # no gold: not gated
        assert res.num_recomputed == res.num_context_tokens == ref.num_context_tokens


def test_the_slo_defaults_have_one_home():
    """The server, the vLLM connector and `ask` take the SLO default and ceiling from `request`."""
    from cachesmith.integrations.prompt_kv import ConnectorParams
    from cachesmith.request import DEFAULT_SLO_S, MAX_SLO_S
    from cachesmith.server.specs import ServiceConfig

    config = ServiceConfig()
    assert (config.default_slo_s, config.max_slo_s) == (DEFAULT_SLO_S, MAX_SLO_S)
    assert ConnectorParams(0, (1,)).slo_ms == DEFAULT_SLO_S * 1000.0
    with pytest.raises(InputError, match=f"cachesmith.slo_ms={MAX_SLO_S * 1000 + 1}: must be a positive number and "
                                         f"at most {MAX_SLO_S * 1000:.10g}"):
        ConnectorParams.parse({"num_prefix_tokens": 0, "chunk_token_counts": [1], "slo_ms": MAX_SLO_S * 1000 + 1}, 3)
