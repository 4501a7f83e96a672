"""Requests as OpenAI clients and frameworks send them: plain chats without documents, fields the
server does not act on (accepted, logged, named in a header), fields whose meaning it would break
(refused by name), `--strict`, and documents sent as marked content parts."""
from __future__ import annotations

import httpx
import pytest

from cachesmith.server import ServerConfig
from cachesmith.server.app import IGNORED_HEADER
from tests.server.conftest import NAME
from tests.server.test_app import DOCS, error_of

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

QUESTION = "Which word comes after river?"


def chat(**extra) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **extra}


def test_a_plain_chat_is_served_and_its_next_turn_reads_the_stored_conversation(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        first = c.post("/v1/chat/completions", json=chat())
        assert first.status_code == 200, first.text
        reply = first.json()
        assert reply["usage"]["prompt_tokens"] > 0 and reply["cachesmith"]["num_context_tokens"] == 0
        messages = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "."},
                    {"role": "user", "content": "And which comes after glacier?"}]
        second = None
        for _ in range(50):  # the first turn's exchange is stored off the request path
            second = c.post("/v1/chat/completions", json=chat(messages=messages)).json()
            if second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                break
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second["usage"]
        plain = c.post("/v1/completions", json={"model": NAME, "prompt": QUESTION, "max_tokens": 3})
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_fields_the_server_does_not_act_on_are_accepted_and_named(server_for):
    srv = server_for()
    framework = {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
                 "tool_choice": "none", "parallel_tool_calls": False, "store": False, "metadata": {"app": "x"},
                 "service_tier": "auto", "response_format": {"type": "text"}, "logit_bias": {},
                 "frobnicate": 3, "documents": DOCS}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(**framework))
        assert r.status_code == 200, r.text
        named = r.headers[IGNORED_HEADER].split(", ")
        assert set(named) == {"tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                              "response_format", "logit_bias", "frobnicate"}
        assert named[-1] == "frobnicate"  # known fields first, then unknown ones
        streamed = c.post("/v1/chat/completions", json=chat(stream=True, frobnicate=1, documents=DOCS))
        assert streamed.status_code == 200 and streamed.headers[IGNORED_HEADER] == "frobnicate"
        assert IGNORED_HEADER not in c.post("/v1/chat/completions", json=chat(documents=DOCS)).headers
        echoed = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                                    "refusal": None},
                                {"role": "user", "content": QUESTION}])
        assert c.post("/v1/chat/completions", json=echoed).headers[IGNORED_HEADER] == "messages[1].refusal"


@pytest.mark.parametrize("change, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not call tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tools", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "none"),
    ({"response_format": {"type": "json_object"}}, "response_format.type", "text"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "cannot bias"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "None"),
    ({"modalities": ["text", "audio"]}, "modalities[1]", "text"),
    ({"functions": [{"name": "f"}]}, "functions", "at most 0"),
    ({"n": 2}, "n", "less than or equal to 1"),
])
def test_fields_whose_meaning_would_break_are_refused_by_name(server_for, change, param, words):
    srv = server_for()
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(**change), timeout=60)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err


def test_strict_refuses_unknown_fields_and_says_so_in_the_schema(server_for):
    srv = server_for(server=ServerConfig(port=0, log_level="warning", is_strict=True))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(frobnicate=1, documents=DOCS))
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "frobnicate" and "--strict" in err["message"]
        ok = c.post("/v1/chat/completions", json=chat(store=True, documents=DOCS))  # known: still accepted
        assert ok.status_code == 200 and ok.headers[IGNORED_HEADER] == "store"
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    lenient = server_for()
    schema = httpx.get(lenient.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    assert schema["CompletionRequest"]["additionalProperties"] is True


def _parts(*texts, question=QUESTION) -> list[dict]:
    return [{"type": "text", "text": t, "document": True} for t in texts] + [{"type": "text", "text": question}]


def test_documents_sent_as_marked_content_parts_are_documents(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        want = c.post("/v1/chat/completions", json=chat(documents=DOCS, max_tokens=6)).json()
        got = c.post("/v1/chat/completions", json=chat(
            messages=[{"role": "user", "content": _parts(*DOCS)}], max_tokens=6)).json()
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["cachesmith"]["num_context_tokens"] == want["cachesmith"]["num_context_tokens"] > 0
        # one in a system message, one in the field: the field's first, then the messages' in order
        mixed = c.post("/v1/chat/completions", json=chat(documents=DOCS[:1], max_tokens=6, messages=[
            {"role": "system", "content": [{"type": "text", "text": DOCS[1], "document": True}]},
            {"role": "user", "content": QUESTION}])).json()
        assert mixed["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        stored = {x["text"] for x in c.get("/v1/chunks").json()["data"]}
        assert set(DOCS) <= {t.strip() for t in stored}


def test_document_parts_of_earlier_turns_are_their_text_and_documents_alone_are_asked_about(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        earlier = c.post("/v1/chat/completions", json=chat(messages=[
            {"role": "user", "content": _parts(DOCS[0])}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": QUESTION}])).json()
        assert earlier["cachesmith"]["num_context_tokens"] == 0  # no chunk: the turn's text
        alone = c.post("/v1/chat/completions", json=chat(messages=[
            {"role": "user", "content": [{"type": "text", "text": DOCS[0], "document": True}]}])).json()
        assert alone["cachesmith"]["num_context_tokens"] > 0 and alone["usage"]["completion_tokens"] > 0
        odd = c.post("/v1/chat/completions", json=chat(**{"caf\u00e9\u2603": 1, "x" * 2000: 2}, documents=DOCS))
        assert odd.status_code == 200 and "caf%C3%A9%E2%98%83" in odd.headers[IGNORED_HEADER]
        assert len(odd.headers[IGNORED_HEADER]) <= 1024 + 5


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "user", "content": [{"type": "text", "text": "x", "document": 1}]}],
     "messages[0].content[0].document", "true or false"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content", ""),
])
def test_bad_content_parts_are_refused_by_name(server_for, messages, param, words):
    srv = server_for()
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(messages=messages), timeout=60)
    err = error_of(r)
    assert r.status_code == 400 and err["param"].startswith(param) and words in err["message"], err
