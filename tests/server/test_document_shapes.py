"""The document shapes other RAG clients send (Cohere's `{"id", "data"}`, vLLM's `{"title", "text"}`)
are the same passage as the string "title\\ntext", and a bad one is a 400 naming its field."""
from __future__ import annotations

import httpx
import pytest

from cachesmith.server.schemas import ChatCompletionRequest, CompletionRequest
from cachesmith.server.specs import DocumentRef
from tests.server.conftest import NAME

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

TITLE, TEXT = "Glacier lantern", "river glacier lantern harbor meadow falcon"
PLAIN = f"{TITLE}\n{TEXT}"
COHERE = {"id": "doc-7", "data": {"title": TITLE, "snippet": TEXT, "url": "https://example.org/7", "rank": 1}}
VLLM = {"title": TITLE, "text": TEXT}


def completion(documents: list) -> dict:
    return {"model": NAME, "prompt": "Which word comes after river?", "documents": documents, "max_tokens": 4}


@pytest.mark.parametrize("doc, passage", [
    (COHERE, PLAIN),
    ({"data": {"title": TITLE, "text": TEXT}}, PLAIN),
    ({"id": "0" * 64, "data": {"snippet": TEXT}}, TEXT),  # a Cohere id is the client's, never a chunk id
    ({"data": {"title": " ", "snippet": TEXT}}, TEXT),
    ({"data": {"snippet": "s", "text": "t"}}, "s"),
    (VLLM, PLAIN),
    ({"text": TEXT}, TEXT),
    ({"id": "a" * 64}, None),
])
def test_each_shape_is_one_passage(doc, passage):
    want = DocumentRef(chunk_id="a" * 64) if passage is None else DocumentRef(text=passage)
    spec = CompletionRequest(**completion([doc])).to_spec()
    chat = ChatCompletionRequest(model=NAME, documents=[doc], messages=[{"role": "user", "content": "q"}]).to_spec()
    assert spec.documents == chat.documents == (want,)


def stored_ids(c: httpx.Client) -> set[str]:
    return {x["id"] for x in c.get("/v1/chunks").json()["data"]}


def test_cohere_and_vllm_documents_store_the_chunk_of_the_plain_string(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        by_cohere = c.post("/v1/completions", json=completion([COHERE]))
        assert by_cohere.status_code == 200, by_cohere.text
        stored = stored_ids(c)
        added = c.post("/v1/chunks", json={"documents": [PLAIN]}).json()["data"][0]
        assert added["is_new"] is False and added["id"] in stored  # the Cohere document stored it
        by_vllm = c.post("/v1/completions", json=completion([VLLM]))
        by_plain = c.post("/v1/completions", json=completion([PLAIN]))
        by_chat = c.post("/v1/chat/completions", json={"model": NAME, "documents": [COHERE], "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Which word?"}]})
        assert by_chat.status_code == 200
        # no other passage was stored; the chat's finished exchange may be (off the request's path,
        # so maybe not yet) as the KV its next turn extends, and that record holds the question
        extra = {x["id"]: x["text"] for x in c.get("/v1/chunks").json()["data"] if x["id"] not in stored}
        assert len(extra) <= 1 and all("Which word?" in text for text in extra.values()), extra
    answers = [r.json()["choices"][0]["text"] for r in (by_cohere, by_vllm, by_plain)]
    assert answers[0] == answers[1] == answers[2]


def test_bad_documents_name_their_field(server_for):
    srv = server_for()
    cases = [
        ({"id": "doc-1", "data": {"title": TITLE}}, "documents[1].data", 'needs "snippet" or "text"'),
        ({"data": {"snippet": "  "}}, "documents[1].data", "snippet must not be empty"),
        ({"data": {"title": TITLE, "text": ""}}, "documents[1].data", "text must not be empty"),
        ({"data": {"text": 7}}, "documents[1].data.text", "valid string"),
        ({"data": "just text"}, "documents[1].data", "valid dictionary"),
        ({"title": TITLE}, "documents[1].text", "Field required"),
        ({"title": TITLE, "text": " "}, "documents[1].text", "must not be empty"),
        ({"id": "a" * 64, "text": TEXT}, "documents[1].id", "Extra inputs"),
        ({"name": TITLE}, "documents[1]", "a document is a string"),
        (["nested"], "documents[1]", "a document is a string"),
    ]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for doc, param, words in cases:
            r = c.post("/v1/completions", json=completion([TEXT, doc]))
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, param) and words in err["message"], (doc, err)


def test_the_published_non_blank_pattern_is_the_services_strip():
    # the schema's pattern and the service's `str.strip()` must call the same characters blank, or a
    # schema-valid document is refused (or an invalid one served): the fuzzer found "\x1f"
    import re

    from cachesmith.server.schemas import NON_BLANK

    blank = [c for c in map(chr, range(0x110000)) if not c.strip()]
    assert blank and not any(re.search(NON_BLANK, c) for c in blank)
    assert all(re.search(NON_BLANK, c) for c in ("a", "\u200b", "\ufeff", "\x00", "\x1b"))
