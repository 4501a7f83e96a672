"""The official `openai` client against the server on the packaged model: the API is compatible,
streamed and whole answers agree with the pipeline, and the extensions ride in `extra_body`."""
from __future__ import annotations

import openai
import pytest

from cachesmith.engine import EngineConfig
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model import greedy_decode
from cachesmith.pipeline import RagPipeline
from cachesmith.calibration.packaged import find_profile
from cachesmith.recompute import full_prefill
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.run import BackgroundServer

pytestmark = pytest.mark.real_model

DOCS = ["The capital of Freedonia is Port Lantern. It lies on the river Velm.",
        "Sylvania's capital is Glimmerton, known for its copper mines."]
QUESTION = "What is the capital of Freedonia?"
KEY = "test-key"


@pytest.fixture(scope="module")
def served():
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    service = Service(ServiceConfig(engine=EngineConfig("full_prefill", "live")), pipe, find_profile(pipe)[0])
    with BackgroundServer(service, ServerConfig(port=0, api_key=KEY, log_level="warning")) as srv:
        yield srv, pipe, openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def test_chat_whole_and_streamed_match_the_pipeline(served):
    srv, pipe, client = served
    want = pipe.answer(DOCS, QUESTION, full_prefill(pipe.model.num_layers), max_new_tokens=24).text
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                           extra_body={"documents": DOCS, "slo_ms": 30_000, "gold": ["Port Lantern"]})
    assert whole.choices[0].message.content == want and "Port Lantern" in want
    assert whole.usage.completion_tokens > 0 and whole.model_extra["cachesmith"]["is_passed"] is True
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=24, stream=True, extra_body={"documents": DOCS})
        if ch.choices]
    assert len(pieces) > 2 and "".join(pieces) == want


def test_completion_with_stop_and_stream(served):
    srv, pipe, client = served
    kwargs = dict(model="smollm2-135m", prompt="What is the capital of Sylvania?", max_tokens=24, stop=["."],
                  extra_body={"documents": DOCS})
    whole = client.completions.create(**kwargs)
    text = whole.choices[0].text
    assert "Glimmerton" in text and "." not in text and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices) == text


def test_client_errors_map_to_openai_exceptions(served):
    srv, _, client = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", extra_body={"documents": DOCS})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # tools it would have to call
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]


def test_seeded_sampling_repeats_and_logprobs_agree_with_greedy(served):
    srv, pipe, client = served
    hot = dict(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
               temperature=1.3, top_p=0.95, seed=11, extra_body={"documents": DOCS})
    first, again = (client.chat.completions.create(**hot).choices[0].message.content for _ in range(2))
    assert first and first == again
    greedy = client.chat.completions.create(model="smollm2-135m", messages=hot["messages"], max_tokens=16,
                                            logprobs=True, top_logprobs=3, extra_body={"documents": DOCS})
    content = greedy.choices[0].logprobs.content
    assert content and all(e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
                           and len(e.top_logprobs) == 3 for e in content)  # temperature 0: the top token
    assert "".join(e.token for e in content).strip() == greedy.choices[0].message.content
    text = client.completions.create(model="smollm2-135m", prompt=QUESTION, max_tokens=8, logprobs=2,
                                     extra_body={"documents": DOCS}).choices[0]
    assert len(text.logprobs.tokens) == len(text.logprobs.token_logprobs) == len(text.logprobs.top_logprobs) > 0
    assert all(lp <= 0 for lp in text.logprobs.token_logprobs)
    streamed = [e for ch in client.chat.completions.create(
        model="smollm2-135m", messages=hot["messages"], max_tokens=16, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"documents": DOCS}) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]  # joined, the same


def test_a_three_turn_chat_reuses_the_stored_earlier_turns(served):
    srv, pipe, client = served
    questions = ["Which river does the capital of Freedonia lie on?", "And what is it called?", "Thanks. Again?"]
    messages, turns, cached = [], [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12,
                                               extra_body={"documents": DOCS})
        answer = reply.choices[0].message.content
        cached.append((reply.usage.prompt_tokens_details.cached_tokens, reply.model_extra["cachesmith"]))
        messages.append({"role": "assistant", "content": answer})
        turns += [("user", question), ("assistant", answer)]
    for k in (1, 2):  # turns 2 and 3 read every earlier exchange from the store
        earlier = len(pipe.tokenizer.conversation_ids(None, turns[:2 * k]))
        assert cached[k][0] >= earlier and cached[k][1]["cached_tokens"]["prefix"] >= earlier, (k, cached)


def test_a_plain_chat_without_documents_reads_its_conversation_on_the_next_turn(served):
    srv, pipe, client = served
    messages = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=8)
    parts = pipe.prompt([], "Name a colour.")
    logits, cache = pipe.model.prefill(parts.prefix_ids + parts.suffix_ids)  # nothing approximated
    want = pipe.tokenizer.decode(greedy_decode(pipe.model, logits, cache, 8)).strip()
    assert first.choices[0].message.content.strip() == want and first.usage.completion_tokens > 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Another one?"}]
    for _ in range(50):  # the first exchange is stored off the request path
        second = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=8)
        if second.usage.prompt_tokens_details.cached_tokens > 0:
            break
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_framework_fields_are_accepted_and_named(served):
    srv, pipe, client = served
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        tool_choice="none", parallel_tool_calls=False, store=False, metadata={"app": "rag"},
        response_format={"type": "text"}, extra_body={"documents": DOCS, "x_trace": "1"})
    reply = raw.parse()
    assert "Port Lantern" in reply.choices[0].message.content
    assert set(raw.headers["x-cachesmith-ignored-fields"].split(", ")) == {
        "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "response_format", "x_trace"}


def test_documents_as_marked_content_parts_answer_as_the_documents_field(served):
    srv, pipe, client = served
    want = pipe.answer(DOCS, QUESTION, full_prefill(pipe.model.num_layers), max_new_tokens=24).text
    content = [{"type": "text", "text": d, "document": True} for d in DOCS] + [{"type": "text", "text": QUESTION}]
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": content}],
                                           max_tokens=24)
    assert reply.choices[0].message.content == want and reply.model_extra["cachesmith"]["num_context_tokens"] > 0
