"""The HTTP API with a real client (httpx) against a real uvicorn on a loopback port."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cachesmith.server import ServerConfig
from tests.server.conftest import NAME

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

DOCS = ["river glacier lantern harbor meadow falcon", "copper amber silent frozen canyon velvet"]


def body(**extra) -> dict:
    return {"model": NAME, "prompt": "Which word comes after river?", "documents": DOCS, "max_tokens": 4, **extra}


def error_of(response: httpx.Response) -> dict:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def sse_events(text: str) -> list:
    lines = [line for line in text.split("\n\n") if line.strip()]
    assert all(line.startswith("data: ") for line in lines), text
    return [line[len("data: "):] for line in lines]


def test_completion_chat_models_and_health(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").json()["status"] == "ok"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [NAME]
        r = c.post("/v1/completions", json=body(slo_ms=4000)).json()
        assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] in ("stop", "length")
        assert r["usage"]["completion_tokens"] <= 4 and r["usage"]["prompt_tokens"] > r["cachesmith"]["num_context_tokens"]
        assert r["cachesmith"]["slo_ms"] == 4000 and r["cachesmith"]["ttft_ms"] > 0
        chat = c.post("/v1/chat/completions", json={
            "model": NAME, "documents": DOCS, "max_tokens": 3,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which word?"}]}).json()
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"


def test_streaming_is_server_sent_events_ending_in_done(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={
            "model": NAME, "documents": DOCS, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "Which word?"}]})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and "cachesmith" in finals[0]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 5


@pytest.mark.parametrize("change, status, param, words", [
    ({"documents": [{"id": "0" * 64}]}, 404, "documents[0].id", "unknown chunk id"),
    ({"documents": [{"id": "not-a-key"}]}, 400, "documents[0].id", "64 lower-case hex"),
    ({"documents": [{"idd": "x"}]}, 400, "documents[0]", "a document is a string"),
    ({"documents": [{"id": "0" * 64, "idd": "x"}]}, 400, "documents[0].idd", "Extra inputs"),
    ({"documents": ["   "]}, 400, "documents[0]", "must not be empty"),
    ({"documents": ["word " * 1200]}, 400, "documents", "positions"),
    ({"slo_ms": -5}, 400, "slo_ms", "must be a positive number"),
    ({"max_tokens": 100_000}, 400, "max_tokens", "between 1 and 512"),
    ({"temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ({"temperature": -0.1}, 400, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ({"top_k": -1}, 400, "top_k", "greater than or equal to 0"),
    ({"presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    ({"logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    # JSON types as the schema publishes them: no booleans for numbers, no numbers for booleans
    ({"stream": 0}, 400, "stream", "true or false"),
    ({"logprobs": True}, 400, "logprobs", "not a boolean"),
    ({"temperature": True}, 400, "temperature", "not a boolean"),
    ({"logprobs": 2.5}, 400, "logprobs", "fractional part"),
    ({"n": 2}, 400, "n", "less than or equal to 1"),
    ({"logit_bias": {"1": 2}}, 400, "logit_bias", "cannot bias token choices"),
    ({"model": "gpt-9"}, 404, "model", "does not exist"),
])
def test_bad_requests_name_the_field(server_for, change, status, param, words):
    srv = server_for()
    r = httpx.post(srv.url + "/v1/completions", json=body(**change), timeout=60)
    err = error_of(r)
    assert r.status_code == status and err["param"] == param and words in err["message"], err


def test_malformed_json_non_utf8_and_multi_turn_chat(server_for):
    srv = server_for()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", content=b"{not json", headers=headers)
        assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
        r = c.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=headers)
        assert r.status_code == 400
        r = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "messages": [
            {"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]})
        assert r.status_code == 400 and "a user message" in error_of(r)["message"]
        r = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "max_tokens": 2.0, "messages": [
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2  # any order the template renders
        r = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]})
        assert r.status_code == 200  # a follow-up turn
        r = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "messages": [
            {"role": "user", "content": "many words " * 2000}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"  # longer than the positions
        assert c.get("/health").status_code == 200  # nothing above hurt the server


def test_api_key_and_body_limit(server_for):
    srv = server_for(ServerConfig(port=0, api_key="s3cret", max_body_bytes=4096, log_level="warning"))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200  # open, for load balancers
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/metrics").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        big = body(documents=["x" * 5000])
        r = c.post("/v1/completions", json=big, headers=auth)
        assert r.status_code == 413 and "4096 bytes" in error_of(r)["message"]
        r = c.post("/v1/completions", content=(b"x" * 1000 for _ in range(10)),  # chunked: no length given
                   headers={**auth, "content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
        assert c.post("/v1/completions", json=body(), headers=auth).status_code == 200


def test_queue_limit_answers_429_with_retry_after(server_for):
    srv = server_for(max_queue=2)
    service = srv.server.config.app.state.service
    engine = service.engine
    gate, entered, original = threading.Event(), threading.Event(), engine.prefill_batch

    def held(decision, batch):  # hold the first batch so the queue fills behind it
        entered.set()
        gate.wait(30)
        return original(decision, batch)

    engine.prefill_batch = held
    codes: list[int] = []

    def client(i):
        codes.append(httpx.post(srv.url + "/v1/completions", json=body(prompt=f"q{i}?"), timeout=60).status_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    threads[0].start()
    assert entered.wait(10)  # one taken by the loop ...
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10
    while service.queue_depth < 2 and time.monotonic() < deadline:  # ... then two queued
        time.sleep(0.01)
    r = httpx.post(srv.url + "/v1/completions", json=body(), timeout=60)
    assert r.status_code == 429 and int(r.headers["retry-after"]) == 1  # no batch has run: 1 s a batch
    engine.stats.busy_s, engine.stats.num_batches = 10.0, 4  # as if 4 batches had taken 2.5 s each
    r = httpx.post(srv.url + "/v1/completions", json=body(), timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"  # one batch (2 waiting, 8 a batch), rounded up
    assert error_of(r)["code"] == "queue_full" and "max_queue=2" in error_of(r)["message"]
    gate.set()
    for t in threads:
        t.join(60)
    assert codes == [200, 200, 200]


def test_concurrent_clients_are_batched_and_all_served(server_for):
    import asyncio

    srv = server_for(max_queue=64)

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body(prompt=f"Question {i}?",
                                                                            stream=i % 2 == 1))
                                          for i in range(16)])

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 16
    sizes = [r.json()["cachesmith"]["batch_size"] for r in responses if not r.headers["content-type"].startswith("text/")]
    assert max(sizes) > 1  # requests that waited together ran together
    streamed = [r for r in responses if r.headers["content-type"].startswith("text/event-stream")]
    assert len(streamed) == 8 and all(sse_events(r.text)[-1] == "[DONE]" for r in streamed)


def test_chunk_api_add_list_get_delete(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        added = c.post("/v1/chunks", json={"documents": DOCS}).json()["data"]
        assert [a["is_new"] for a in added] == [True, True] and added[0]["text"].startswith(DOCS[0])
        again = c.post("/v1/chunks", json={"documents": DOCS[:1]}).json()["data"]
        assert again[0]["id"] == added[0]["id"] and again[0]["is_new"] is False
        listed = c.get("/v1/chunks").json()
        assert {a["id"] for a in added} <= {x["id"] for x in listed["data"]} and listed["has_more"] is False
        first = c.get("/v1/chunks", params={"limit": 1}).json()
        assert len(first["data"]) == 1 and first["has_more"] is True
        rest = c.get("/v1/chunks", params={"after": first["data"][0]["id"]}).json()["data"]
        assert first["data"][0]["id"] not in {x["id"] for x in rest}
        one = c.get(f"/v1/chunks/{added[1]['id']}").json()
        assert one["num_tokens"] == added[1]["num_tokens"] > 0 and one["tiers"] == ["memory"]
        by_id = c.post("/v1/completions", json=body(documents=[{"id": a["id"]} for a in added]))
        assert by_id.status_code == 200
        assert c.delete(f"/v1/chunks/{added[0]['id']}").json()["deleted"] is True
        r = c.delete(f"/v1/chunks/{added[0]['id']}")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = c.post("/v1/completions", json=body(documents=[{"id": added[0]["id"]}]))
        assert r.status_code == 404 and "unknown chunk id" in error_of(r)["message"]
        assert c.get("/v1/chunks/xyz").status_code == 400
        assert c.post("/v1/chunks", json={"documents": []}).status_code == 400


def test_deleting_a_chunk_in_use_is_refused(server_for):
    srv = server_for()
    service = srv.server.config.app.state.service
    engine = service.engine
    cid = httpx.post(srv.url + "/v1/chunks", json={"documents": DOCS[:1]}, timeout=60).json()["data"][0]["id"]
    gate, original = threading.Event(), engine.prefill_batch
    engine.prefill_batch = lambda d, b: (gate.wait(30), original(d, b))[1]
    out = {}
    t = threading.Thread(target=lambda: out.update(r=httpx.post(
        srv.url + "/v1/completions", json=body(documents=[{"id": cid}]), timeout=60)))
    t.start()
    deadline = time.monotonic() + 10
    while not service.chunks._pins.get(cid) and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.delete(f"{srv.url}/v1/chunks/{cid}", timeout=60)
    assert r.status_code == 409 and error_of(r)["code"] == "chunk_in_use"
    gate.set()
    t.join(60)
    assert out["r"].status_code == 200
    assert httpx.delete(f"{srv.url}/v1/chunks/{cid}", timeout=60).status_code == 200  # free now


def test_metrics_count_what_was_served(server_for):
    srv = server_for()
    usages = []
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for i in range(3):
            r = c.post("/v1/completions", json=body(prompt=f"Q{i}?", slo_ms=60_000))
            assert r.status_code == 200
            usages.append(r.json()["usage"])
        c.post("/v1/completions", json=body(documents=[{"id": "0" * 64}]))
        text = c.get("/metrics").text
    assert f'cachesmith:requests_served_total{{gate="none",model_name="{NAME}",on_time="true"}} 3.0' in text
    assert f'cachesmith:time_to_first_token_seconds_count{{model_name="{NAME}"}} 3.0' in text
    assert f'cachesmith:requests_rejected_total{{model_name="{NAME}",reason="invalid"}} 1.0' in text
    assert f'cachesmith:queue_depth{{model_name="{NAME}"}} 0.0' in text and "cachesmith:store_hit_rate{" in text
    assert f'cachesmith:store_tier_up{{model_name="{NAME}",tier="memory"}} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert 1 <= values["cachesmith:batches_total"] <= 3 and values["cachesmith:busy_seconds_total"] > 0
    assert values["cachesmith:prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in usages)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert values["cachesmith:prefix_cache_hits_total"] == hits > 0  # the same documents and prefix again


def test_a_last_assistant_message_is_the_answer_prefix(server_for):
    srv = server_for()
    messages = [{"role": "user", "content": "Which word?"}]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        cont = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "max_tokens": 3, "messages": [
            *messages, {"role": "assistant", "content": "The word is"}]}).json()
        field = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "max_tokens": 3,
                                                     "messages": messages, "answer_prefix": "The word is"}).json()
        plain = c.post("/v1/chat/completions", json={"model": NAME, "documents": DOCS, "max_tokens": 3,
                                                     "messages": messages}).json()
        both = c.post("/v1/chat/completions", json={
            "model": NAME, "documents": DOCS, "max_tokens": 3, "max_completion_tokens": 5, "answer_prefix": " is",
            "messages": [*messages, {"role": "assistant", "content": "The word"}]}).json()
    assert cont["usage"]["prompt_tokens"] == field["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    # answer_prefix goes on after the assistant message; of two token limits the tighter holds
    count = lambda u: (u["prompt_tokens"], u["completion_tokens"])  # noqa: E731 (the cache differs: stored by now)
    assert count(both["usage"]) == count(cont["usage"]) and both["choices"][0]["message"] == cont["choices"][0]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_abandoned_while_queued_is_cancelled(server_for, stream):
    srv = server_for()
    service = srv.server.config.app.state.service
    engine = service.engine
    gate, entered, original = threading.Event(), threading.Event(), engine.prefill_batch
    engine.prefill_batch = lambda d, b: (entered.set(), gate.wait(30), original(d, b))[2]
    first = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", json=body(), timeout=60))
    first.start()
    assert entered.wait(10)  # the loop took the first request, and holds it
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before any token
        httpx.post(srv.url + "/v1/completions", json=body(stream=stream), timeout=1.0)
    deadline = time.monotonic() + 10
    while service.queue_depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.queue_depth == 0  # dropped, not left to be served to nobody
    gate.set()
    first.join(60)
    text = httpx.get(srv.url + "/metrics", timeout=60).text
    assert f'cachesmith:requests_failed_total{{model_name="{NAME}",reason="cancelled"}} 1.0' in text
    assert engine.stats.num_batches == 1  # only the first request ran


def test_draining_answers_503_until_the_queue_is_served(server_for):
    srv = server_for()
    service = srv.server.config.app.state.service
    gate, entered, original = threading.Event(), threading.Event(), service.engine.prefill_batch

    def held(decision, batch):
        entered.set()
        gate.wait(30)
        return original(decision, batch)

    service.engine.prefill_batch = held
    out: dict = {}
    client = threading.Thread(target=lambda: out.update(r=httpx.post(srv.url + "/v1/completions", json=body(),
                                                                      timeout=60)))
    client.start()
    assert entered.wait(10)
    closer = threading.Thread(target=lambda: out.update(drained=service.close(30)))
    closer.start()
    deadline = time.monotonic() + 10
    while not service.loop.is_closing and time.monotonic() < deadline:
        time.sleep(0.01)
    health = httpx.get(srv.url + "/health", timeout=10)
    refused = httpx.post(srv.url + "/v1/completions", json=body(), timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503
    gate.set()
    client.join(60)
    closer.join(60)
    assert out["r"].status_code == 200 and out["drained"] is True  # the request in flight was served
