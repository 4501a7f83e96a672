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
NUM_SAMPLED = 3  # of them sampled (seeded): the 2nd, 5th and 8th streams
MAX_TOKENS = 6
METHOD = "cacheblend@0.15"  # a fixed plan: the tokens depend on the math alone, not on timing


def start(model_dir, device: str, root) -> BackgroundServer:
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=root))
    config = ServiceConfig(model=str(model_dir), device=device, served_name=NAME,
                           engine=EngineConfig(method=METHOD, clock="live"))
    pipe = RagPipeline(str(model_dir), device=device, store=store)
    return BackgroundServer(Service(config, pipe, replace(tiny_profile(pipe)))).start()


def post(client: httpx.Client, messages: list[dict], documents=None, stream: bool = False, seed: int | None = None) -> str:
    """Greedy, or with `seed` sampled (the same seed and request give the same text)."""
    body = {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if seed is not None:
        body.update(temperature=0.8, seed=seed)
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
        with ThreadPoolExecutor(8) as pool:  # every third sampled: greedy and sampled rows decode together
            out["streams"] = list(pool.map(lambda jq: post(client, jq[1], DOCS[:2], stream=True,
                                                           seed=jq[0] if jq[0] % 3 == 1 else None),
                                           enumerate(questions)))
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
        graphs = srv.service.loop._decoding.graphs  # the decode thread's graph buckets
    finally:
        srv.stop()
    assert answers == cpu_answers
    assert answers["rag_new"] == answers["rag_stored"] and len(answers["streams"]) == 8
    assert counts.findings == [] and counts.ops > 0 and counts.attention["math"] == 0
    # the host waits only where it must: each decode step's tokens (one event), per request its
    # first token, its first choice and its entropy (read once the batch is done), and each sampled
    # token its draw
    # and where a decode graph is captured (torch's graph context synchronizes the device): once per bucket
    num_capture_syncs = sum(site.startswith("CUDA graph capture") for site in counts.sync_sites)
    print(f"decode graph captures: {counts.captures}, buckets {list(graphs._buckets)}, replays: {counts.replays}")
    assert counts.captures == num_capture_syncs == graphs.num_captures == len(graphs._buckets)  # each bucket once
    assert counts.replays > counts.captures
    num_sampled_tokens = NUM_SAMPLED * MAX_TOKENS
    assert counts.syncs - counts.sync_sites.count("event.synchronize") - num_capture_syncs <= \
        3 * NUM_REQUESTS + num_sampled_tokens, counts.sync_sites
