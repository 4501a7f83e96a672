"""Admission under load and failure: a request holds its place in the queue from its acceptance, so
a burst past `max_queue` is refused (429) before any tokenizing or prefill; an admission that raises
gives its place back; uvicorn refuses connections past `max_connections`; the API key is checked
before the body is read."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from cachesmith.scheduler.feasibility import SheddingConfig
from cachesmith.shedding import SloUnattainable
from cachesmith.server import ServerConfig
from cachesmith.server.run import CONNECTION_MARGIN, max_connections
from tests.server.test_app import body, error_of

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer


def passage(i: int) -> str:
    return f"passage number {i} of the burst: river glacier lantern harbor"


def test_a_burst_past_the_queue_is_refused_before_any_tokenizing_or_prefill(server_for):
    srv = server_for(max_queue=3)
    service = srv.server.config.app.state.service
    tokenizer, store = service.pipeline.tokenizer, service.store
    chunk_ids, ensure = tokenizer.chunk_ids, store.ensure_held
    tokenized, prefilled = [], []
    gate, entered = threading.Event(), threading.Event()

    def spy_chunk_ids(text, *args, **kwargs):
        tokenized.append(text)
        return chunk_ids(text, *args, **kwargs)

    def spy_ensure(model, ids, *args):  # the first prefill holds the admission lock until the gate opens
        prefilled.append(tokenizer.decode(ids))
        if not entered.is_set():
            entered.set()
            gate.wait(30)
        return ensure(model, ids, *args)

    tokenizer.chunk_ids, store.ensure_held = spy_chunk_ids, spy_ensure
    answers: dict[int, httpx.Response] = {}

    def client(i):
        answers[i] = httpx.post(srv.url + "/v1/completions", json=body(prompt=f"Q{i}?", documents=[passage(i)]),
                                timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    threads[0].start()
    assert entered.wait(10)  # the first request is prefilling its chunk, and holds its place
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10  # two more take the two places left; the last two are refused now,
    while sum(r.status_code == 429 for r in list(answers.values())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # while the prefill is still held
    refused = [i for i, r in list(answers.items()) if r.status_code == 429]
    assert len(refused) == 2 and not gate.is_set(), {i: r.status_code for i, r in answers.items()}
    for i in refused:
        assert int(answers[i].headers["retry-after"]) >= 1 and error_of(answers[i])["code"] == "queue_full"
        assert "max_queue=3" in error_of(answers[i])["message"]
    gate.set()
    for t in threads:
        t.join(60)
    assert sorted(r.status_code for r in answers.values()) == [200, 200, 200, 429, 429]
    for i in refused:  # nothing was tokenized or prefilled for a refused request
        assert not any(passage(i) in text for text in tokenized + prefilled)
    assert all(any(passage(i) in text for text in prefilled) for i in answers if i not in refused)
    assert service.queue_depth == 0 and service.num_rejected["queue_full"] == 2


def raising(error: BaseException):
    def fail(*args, **kwargs):
        raise error
    return fail


@pytest.mark.parametrize("error", [OSError("disk went away"), MemoryError("no room for the cache")])
def test_an_admission_that_raises_is_a_500_and_gives_its_place_back(server_for, error):
    srv = server_for(max_queue=2)
    service = srv.server.config.app.state.service
    engine, store = service.engine, service.store
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        # more failures than places: a place leaked by each would turn the next request into a 429
        for where, target in (("engine", engine), ("store", store)):
            name = "admit" if where == "engine" else "ensure_held"
            offset = 10 if where == "engine" else 20  # new passages: a stored one is not looked up again
            setattr(target, name, raising(error))
            for i in range(3):
                r = c.post("/v1/completions", json=body(prompt=f"{where} {i}?", documents=[passage(offset + i)],
                                                        stream=i == 1))
                err = error_of(r)
                assert r.status_code == 500 and err["code"] == "internal_error", (where, i, r.text)
                assert f"{type(error).__name__}: {error}" in err["message"]
                assert service.queue_depth == 0 and not service.chunks._pins
            delattr(target, name)  # the class's own method again
        assert c.post("/v1/completions", json=body()).status_code == 200
        assert c.get("/health").json()["queue_depth"] == 0
    assert service.loop._num_admitting == 0


def test_past_max_connections_uvicorn_answers_503_itself(server_for):
    srv = server_for(ServerConfig(port=0, log_level="error", max_connections=2))
    service = srv.server.config.app.state.service
    assert srv.server.config.limit_concurrency == 2
    engine = service.engine
    gate, entered, original = threading.Event(), threading.Event(), engine.prefill_batch
    engine.prefill_batch = lambda d, b: (entered.set(), gate.wait(30), original(d, b))[2]
    held = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", json=body(), timeout=60))
    held.start()
    assert entered.wait(10)
    refused = httpx.get(srv.url + "/health", timeout=10)  # a second connection: one too many
    gate.set()
    held.join(60)
    assert refused.status_code == 503
    deadline = time.monotonic() + 10  # the held connection closes a moment after its answer
    while httpx.get(srv.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_default_connection_limit_leaves_room_for_queue_batch_and_streams(tiny_chat_dir):
    from tests.server.conftest import make_service

    service = make_service(tiny_chat_dir, max_queue=10)
    try:
        batch = service.engine.config.scheduler.max_batch_size
        assert max_connections(service, ServerConfig()) == 10 + batch + service.loop.max_decoding + CONNECTION_MARGIN
        assert max_connections(service, ServerConfig(max_connections=7)) == 7
    finally:
        service.close(10)


def test_the_api_key_is_checked_before_the_body_is_read(server_for):
    srv = server_for(ServerConfig(port=0, api_key="s3cret", max_body_bytes=4096, log_level="warning"))
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", content=b"{not json", headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"  # not the JSON's 400
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v1/chunks", content=b"x" * 8192, headers=headers).status_code == 401  # not a 413
        assert c.get("/v1/no-such-route").status_code == 401
        assert c.get("/health").status_code == 200
        for path in ("/openapi.json", "/docs", "/metrics"):  # what the server is and does: behind the key too
            assert c.get(path).status_code == 401, path
        auth = {**headers, "Authorization": "Bearer s3cret"}
        for path in ("/openapi.json", "/docs", "/metrics"):
            assert c.get(path, headers=auth).status_code == 200, path
        r = c.post("/v1/completions", content=b"{not json", headers=auth)
        assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]


def shed_count(srv, when: str) -> float:
    metrics = httpx.get(srv.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("cachesmith:requests_shed_total") and f'"{when}"' in x)
    return float(line.rsplit(" ", 1)[1])


def hold_first_prefill(service):
    """The first chunk prefill waits for the returned gate: the work ahead of later requests."""
    ensure, gate, entered = service.store.ensure_held, threading.Event(), threading.Event()

    def held(model, ids, *args):
        if not entered.is_set():
            entered.set()
            gate.wait(30)
        return ensure(model, ids, *args)

    service.store.ensure_held = held
    return gate, entered


def work_ahead(srv, service) -> tuple[threading.Event, threading.Thread]:
    """A request with a long new document, held in its prefill (`gate` lets it go): the server is
    busy, and the work ahead of anything new is promised."""
    gate, entered = hold_first_prefill(service)
    ahead = threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/completions", json=body(documents=[" ".join([passage(9)] * 30)], slo_ms=60_000), timeout=60))
    ahead.start()
    assert entered.wait(10)
    return gate, ahead


@pytest.mark.parametrize("max_lateness", [1.5, None])
def test_a_request_that_cannot_be_on_time_is_refused_at_arrival_and_stores_nothing(server_for, max_lateness):
    srv = server_for(shedding=SheddingConfig(max_lateness))
    service = srv.server.config.app.state.service
    gate, entered = hold_first_prefill(service)
    ahead = threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/completions", json=body(documents=[" ".join([passage(9)] * 30)], slo_ms=60_000), timeout=60))
    ahead.start()
    assert entered.wait(10)  # a request ahead is prefilling its new document
    docs = [" ".join([passage(i)] * 8) for i in range(3)]  # new: each would be prefilled before it runs
    start = time.monotonic()
    if max_lateness is None:  # queued however late: served once the work ahead is done
        threading.Timer(0.5, gate.set).start()
        answer = httpx.post(srv.url + "/v1/completions", json=body(documents=docs, slo_ms=20), timeout=60)
        assert answer.status_code == 200 and shed_count(srv, "arrival") == 0
        ahead.join(60)
        return
    answer = httpx.post(srv.url + "/v1/completions", json=body(documents=docs, slo_ms=20), timeout=60)
    refused_s = time.monotonic() - start
    assert not gate.is_set()  # answered while the work ahead still held the cores
    gate.set()
    ahead.join(60)
    assert answer.status_code == 429 and refused_s < 2.0, refused_s
    err = error_of(answer)
    assert (err["code"], err["param"], err["type"]) == ("slo_unattainable", "slo_ms", "rate_limit_error")
    assert "slo_ms=20:" in err["message"] and "of work ahead" in err["message"]
    assert int(answer.headers["Retry-After"]) >= 1
    keys = [service.chunks.key_for(service.pipeline.tokenizer.chunk_ids(d), "") for d in docs]
    assert not any(service.store.contains(k) for k in keys)  # nothing prefilled, nothing stored
    assert shed_count(srv, "arrival") == 1 and shed_count(srv, "queued") == 0
    served = httpx.post(srv.url + "/v1/completions", json=body(documents=docs, slo_ms=60_000), timeout=60)
    assert served.status_code == 200


def test_a_queued_request_shed_past_its_deadline_gets_the_same_429(server_for):
    srv = server_for(max_queue=8)
    service = srv.server.config.app.state.service
    loop = service.loop
    original = loop.deadlines.expired
    # every queued request is infeasible: as if it had waited behind a long burst
    loop.deadlines.expired = lambda queue, now: [(v, f"slo_ms=1: shed {v.request_id}") for v in queue]
    try:
        answer = httpx.post(srv.url + "/v1/completions", json=body(slo_ms=60_000), timeout=60)
    finally:
        loop.deadlines.expired = original
    err = error_of(answer)
    assert answer.status_code == 429 and err["code"] == "slo_unattainable" and "Retry-After" in answer.headers
    assert shed_count(srv, "queued") == 1


def test_a_request_the_work_ahead_alone_makes_late_is_refused_before_it_is_tokenized(server_for):
    srv = server_for()
    service = srv.server.config.app.state.service
    gate, ahead = work_ahead(srv, service)  # its prefill and its batch are promised ahead of anything new
    tokenized = []
    chunk_ids = service.pipeline.tokenizer.chunk_ids
    service.pipeline.tokenizer.chunk_ids = lambda text, *a, **k: tokenized.append(text) or chunk_ids(text, *a, **k)
    answer = httpx.post(srv.url + "/v1/completions", json=body(documents=["a passage nobody stored"], slo_ms=5),
                        timeout=60)
    gate.set()
    ahead.join(60)
    err = error_of(answer)
    assert answer.status_code == 429 and err["code"] == "slo_unattainable" and "sized from its text" in err["message"]
    assert tokenized == [] and shed_count(srv, "arrival") == 1
    assert service.queue_depth == 0  # its place was given back


@pytest.mark.parametrize("slo_ms", [0.5, 0, -3])
def test_an_invalid_slo_on_a_busy_server_is_a_400_naming_it(server_for, slo_ms):
    """Below the minimum SLO (or not positive) is invalid at any load: a 400, never the 429 with a
    Retry-After that a late request gets (its client would retry a request no server takes)."""
    srv = server_for()
    service = srv.server.config.app.state.service
    gate, ahead = work_ahead(srv, service)  # busy: the work ahead alone would make a tight SLO late
    answer = httpx.post(srv.url + "/v1/completions", json=body(documents=["a passage nobody stored"],
                                                                 slo_ms=slo_ms), timeout=60)
    late = httpx.post(srv.url + "/v1/completions", json=body(documents=["a passage nobody stored"], slo_ms=5),
                      timeout=60)
    # every field's limit comes before lateness, in the chat's own field name too
    over = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": body()["model"], "messages": [{"role": "user", "content": "Where?"}], "slo_ms": 5,
        "max_tokens": 4, "max_completion_tokens": 100_000}, timeout=60)
    gate.set()
    ahead.join(60)
    err = error_of(answer)
    assert answer.status_code == 400 and err["param"] == "slo_ms" and f"slo_ms={slo_ms!r}" in err["message"]
    assert "Retry-After" not in answer.headers and shed_count(srv, "arrival") == 1  # the late one only
    assert late.status_code == 429 and error_of(late)["code"] == "slo_unattainable"
    err = error_of(over)
    assert over.status_code == 400 and err["param"] == "max_completion_tokens" and "between 1 and" in err["message"]
    assert service.queue_depth == 0  # every place given back


def test_a_cap_no_retry_passes_is_said_before_lateness(server_for):
    srv = server_for(max_store_tokens_per_request=200)
    service = srv.server.config.app.state.service

    def always_late(slot, new_tokens):  # as if the work ahead made every request late
        raise SloUnattainable("slo_ms=50: late", 2.0)

    service.loop.check_deadline = always_late
    over = [" ".join([passage(i)] * 8) for i in range(3)]  # more new tokens than a request may store
    # an SLO the arrival check (sized from the text) passes: the exact check after tokenizing says late
    answer = httpx.post(srv.url + "/v1/completions", json=body(documents=over, slo_ms=600_000), timeout=60)
    assert answer.status_code == 429 and error_of(answer)["code"] == "store_quota_exceeded"
    assert "Retry-After" not in answer.headers  # waiting would not help
    within = httpx.post(srv.url + "/v1/completions", json=body(documents=[passage(1)], slo_ms=50), timeout=60)
    assert within.status_code == 429 and error_of(within)["code"] == "slo_unattainable"
