"""`Request.from_documents`: a request of the user's own texts, served like a workload request."""
from __future__ import annotations

import pytest

from cachesmith.engine import Engine, EngineConfig
from cachesmith.errors import InputError
from cachesmith.model.sampling import GREEDY
from cachesmith.recompute import full_prefill
from cachesmith.request import Request
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile


def test_from_documents_builds_an_ungated_custom_instance():
    req = Request.from_documents(7, ["First text.", "Second text."], "What?", 2.0, arrival_s=1.5,
                                 max_new_tokens=3, system="Be brief.", answer_prefix="Answer:")
    inst = req.instance
    assert (inst.task, inst.gold, inst.documents, inst.question) == ("custom", (), ("First text.", "Second text."),
                                                                      "What?")
    assert (inst.prefix, inst.answer_prefix, inst.max_new_tokens, inst.chunk_ids) == ("Be brief.", "Answer:", 3, ())
    assert (req.request_id, req.slo_s, req.arrival_s, req.sampling) == (7, 2.0, 1.5, GREEDY)


def test_from_documents_errors_name_the_field():
    with pytest.raises(InputError, match="request 3: documents"):
        Request.from_documents(3, "one text, not a list of them", "q", 1.0)
    with pytest.raises(InputError, match="documents"):
        Request.from_documents(3, ["fine", "  "], "q", 1.0)
    with pytest.raises(InputError, match="question"):
        Request.from_documents(3, ["fine"], " ", 1.0)
    with pytest.raises(InputError, match="max_new_tokens must be >= 1"):
        Request.from_documents(3, ["fine"], "q", 1.0, max_new_tokens=0)


@pytest.mark.real_model  # the tiny model borrows the packaged model's tokenizer
def test_from_documents_runs_through_the_engine_like_the_pipeline(tmp_path_factory):
    pipe = tiny_pipeline(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")), tmp_path_factory.mktemp("kv"))
    reqs = [Request.from_documents(i, instance(i).documents, instance(i).question, 5.0, arrival_s=0.05 * i,
                                   max_new_tokens=3) for i in range(3)]
    eng = Engine(pipe, make_profile(num_layers=pipe.model.num_layers), EngineConfig("full_prefill", "replay"))
    results = eng.run(reqs)
    plan = full_prefill(pipe.model.num_layers)
    for res, req in zip(results, reqs):
        ref = pipe.answer(req.instance.documents, req.instance.question, plan, 3)
        assert res.error is None and res.answer == ref.text
        assert res.task == "custom" and res.is_passed is None  # no gold: not gated
        assert res.num_recomputed == res.num_context_tokens == ref.num_context_tokens
