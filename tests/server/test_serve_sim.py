"""`serve --device cuda` on the simulated CUDA device: every HTTP path a user takes (a RAG request
with new documents, the same documents again from the store, a plain chat and its next turn, eight
concurrent streams) answers with the tokens the same server gives on the CPU, and the device work
raises nothing a GPU would refuse."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from cachesmith.engine import EngineConfig
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.server import Service, ServiceConfig
from cachesmith.server.run import BackgroundServer
from tests.engine_helpers import WORDS, save_tiny_chat_model
from tests.server.conftest import NAME, tiny_profile

pytestmark = [pytest.mark.real_model, pytest.mark.sim_cuda]  # the tiny model borrows the packaged tokenizer

DOCS = [" ".join(WORDS[(d * 5 + i) % len(WORDS)] for i in range(60)) + f" passage {d}." for d in range(3)]
NUM_REQUESTS = 12  # what `session` sends
METHOD = "cacheblend@0.15"  # a fixed plan: the tokens depend on the math alone, not on timing


def start(model_dir, device: str, root) -> BackgroundServer:
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=root))
    config = ServiceConfig(model=str(model_dir), device=device, served_name=NAME,
                           engine=EngineConfig(method=METHOD, clock="live"))
    pipe = RagPipeline(str(model_dir), device=device, store=store)
    return BackgroundServer(Service(config, pipe, replace(tiny_profile(pipe)))).start()


def post(client: httpx.Client, messages: list[dict], documents=None, stream: bool = False) -> str:
    body = {"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream}
    if documents is not None:
        body["documents"] = documents
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(c["choices"][0]["delta"].get("content", "") for c in map(json.loads, events[:-1]) if c["choices"])


def session(url: str) -> dict[str, object]:
    """Every path once, in a user's order; returns each answer's text."""
    ask = [{"role": "user", "content": "Which word comes after river?"}]
    with httpx.Client(base_url=url, timeout=120) as client:
        out = {"rag_new": post(client, ask, DOCS), "rag_stored": post(client, ask, DOCS)}
        out["chat"] = post(client, [{"role": "user", "content": "Name a colour."}])
        out["chat_next"] = post(client, [{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": "Blue, I think."},
                                         {"role": "user", "content": "And another?"}])
        questions = [[{"role": "user", "content": f"Which word follows {w}?"}] for w in WORDS[:8]]
        with ThreadPoolExecutor(8) as pool:
            out["streams"] = list(pool.map(lambda q: post(client, q, DOCS[:2], stream=True), questions))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Weights of a wide spread: answers that differ from question to question."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-spread"), weight_std=0.1)


@pytest.fixture(scope="module")
def cpu_answers(model_dir, tmp_path_factory):
    srv = start(model_dir, "cpu", tmp_path_factory.mktemp("store-cpu"))
    try:
        return session(srv.url)
    finally:
        srv.stop()


def test_every_http_path_answers_on_the_simulated_gpu_as_on_the_cpu(model_dir, tmp_path, cpu_answers, sim_cuda):
    srv = start(model_dir, "cuda", tmp_path)
    try:
        with sim_cuda.count() as counts:
            answers = session(srv.url)
    finally:
        srv.stop()
    assert answers == cpu_answers
    assert answers["rag_new"] == answers["rag_stored"] and len(answers["streams"]) == 8
    assert counts.findings == [] and counts.ops > 0 and counts.attention["math"] == 0
    # the host waits only where it must: each decode step's tokens (one event), and per request its
    # first token, its first choice and its entropy (read once the batch is done)
    assert counts.syncs - counts.sync_sites.count("event.synchronize") <= 3 * NUM_REQUESTS, counts.sync_sites
