"""cachesmith inside vLLM (`cachesmith.integrations.vllm_connector`), on vLLM's CPU build and the
packaged model in float32. Runs only under `make test-vllm`.

- 20 RAG prompts, 32 greedy tokens each, built off vLLM's step (the default): at full coverage the
  plugin gives exactly vLLM's own tokens; with full reuse and CacheBlend@15% exactly the tokens
  cachesmith's own engine gives with the same plan, and full reuse answers differently from vLLM
  alone somewhere (the KV vLLM decodes from really is cachesmith's). A shuffled request is served
  from the store, as its response and vLLM's /metrics say. Equal documents under two cache salts
  are prefilled and stored once per salt, and read back only under their own.
- One redis store shared by vLLM and `cachesmith serve`: each serves chunks the other stored; the
  plan follows the request's SLO; refused parameters and a store that fails leave the request to
  vLLM's own prefill, whose answer it then gives.
- A KV pool too small for the requests at once: vLLM preempts some and resumes them into new
  blocks; the connector rebuilds their KV there (built in the step and off it), and every answer
  is still vLLM's own.
- With vLLM's prefix cache on, the plugin refuses to start and names the flag.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.vllm_server import VllmError, VllmServer, plugin_args
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.methods import parse_method
from cachesmith.model.assets import DEFAULT_MODEL, resolve_model
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import RagPipeline
from cachesmith.workloads.corpus import load_corpus
from tests.redis_server import free_port
from tests.server.test_serve_process import wait_up

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]
NUM_REQUESTS, NUM_TOKENS = 20, 32
QUESTIONS = ("Which of these articles is the longest?", "Name one place mentioned above.",
             "Summarize the second document in one sentence.", "What year appears first?")
METHODS = ("full_prefill", "full_reuse", "cacheblend@0.15")


def vllm_server(*args: str, max_model_len: int = 8192, **extra) -> VllmServer:
    """The plugin's launch as docs/vllm.md gives it (`plugin_args`), with `extra` config."""
    return VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, max_model_len=max_model_len,
                      extra_args=(*plugin_args(DEFAULT_MODEL, **extra), *args))


@pytest.fixture(scope="module")
def pipe():
    return RagPipeline(DEFAULT_MODEL, store=ChunkStore(StoreConfig(tiers=("memory",))))


def documents(i: int) -> list[str]:
    passages = load_corpus().passages
    return [f"{p.title}\n{p.text}"[:1200] for p in passages[3 * i:3 * i + 3]]


def complete(url: str, pipe, docs, question, params: dict | None, num_tokens=NUM_TOKENS,
             **fields) -> tuple[list[int], dict]:
    """(greedy token ids without a final EOS, the response's cachesmith report or {})."""
    return complete_parts(url, pipe, pipe.prompt(docs, question), params, num_tokens, **fields)


def complete_parts(url: str, pipe, parts: PromptParts, params: dict | None, num_tokens=NUM_TOKENS,
                   **fields) -> tuple[list[int], dict]:
    body = {"model": DEFAULT_MODEL, "prompt": parts.token_ids, "max_tokens": num_tokens, "temperature": 0.0,
            "return_token_ids": True, **fields}
    if params is not None:
        layout = {"num_prefix_tokens": len(parts.prefix_ids), "chunk_token_counts": [len(c) for c in parts.chunk_ids]}
        body["kv_transfer_params"] = {"cachesmith": {**layout, **params}}
    r = httpx.post(f"{url}/v1/completions", timeout=600, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return strip(pipe, out["choices"][0]["token_ids"]), (out.get("kv_transfer_params") or {}).get("cachesmith", {})


def strip(pipe, ids: list[int]) -> list[int]:
    eos = pipe.tokenizer.hf.eos_token_id  # EOS is reported by one engine only
    return list(ids[:-1] if ids and ids[-1] == eos else ids)


def ours(pipe, docs, question, method: str) -> list[int]:
    plan = parse_method(method).plan(pipe.model.num_layers)
    return strip(pipe, pipe.answer(docs, question, plan, NUM_TOKENS).token_ids)


def samples(url: str, name: str) -> dict[str, float]:
    """Label values (all but model and engine) -> value, for the series `name` of /metrics."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {",".join(v for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")): s.value
            for f in families for s in f.samples if s.name == name}


def test_the_plugin_answers_as_cachesmith_with_each_plan(pipe, tmp_path):
    requests = [(documents(i), QUESTIONS[i % len(QUESTIONS)]) for i in range(NUM_REQUESTS)]
    expected = {m: [ours(pipe, d, q, m) for d, q in requests] for m in METHODS}
    with vllm_server(store_root=str(tmp_path / "kv")) as server:
        theirs = [complete(server.url, pipe, d, q, None)[0] for d, q in requests]
        plugin = {m: [complete(server.url, pipe, d, q, {"method": m}) for d, q in requests] for m in METHODS}
        shuffled_docs, question = requests[0][0][::-1], requests[0][1]
        shuffled, report = complete(server.url, pipe, shuffled_docs, question, {"method": "cacheblend@0.15"})
        chunks = samples(server.url, "cachesmith:vllm_chunks_total")
        salted = [complete(server.url, pipe, documents(NUM_REQUESTS), question, {"method": "full_reuse"},
                           cache_salt=salt)[1] for salt in ("alice", "bob", "alice")]
    assert [t for t, _ in plugin["full_prefill"]] == theirs  # r = 100%: vLLM's own tokens
    for m in METHODS:
        assert [t for t, _ in plugin[m]] == expected[m], m  # cachesmith's engine's tokens with the same plan
    assert [t for t, _ in plugin["full_reuse"]] != theirs  # the reused KV is what vLLM decoded from
    # first sight prefills and stores each request's three chunks; every later request reads them
    assert all((r["num_chunks_prefilled"], r["num_chunks_stored"]) == (3, 0) for _, r in plugin["full_prefill"])
    assert all(r["num_chunks_stored"] == 3 for m in METHODS[1:] for _, r in plugin[m])
    assert (report["num_chunks_stored"], report["num_chunks_prefilled"], report["plan"]) == (3, 0, "(kv_dev,1,0,15%)")
    assert shuffled == ours(pipe, shuffled_docs, question, "cacheblend@0.15")
    assert chunks == {"store": 3 * (2 * NUM_REQUESTS + 1), "prefilled": 3 * NUM_REQUESTS}
    # equal documents under two salts: stored once per salt, each salt reads only its own
    assert [(r["num_chunks_stored"], r["num_chunks_prefilled"]) for r in salted] == [(0, 3), (0, 3), (3, 0)]


def serve(redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cachesmith.cli", "serve", "--model", DEFAULT_MODEL,
                             "--served-name", DEFAULT_MODEL, "--tiers", "memory", "redis", "--redis-url", redis_url,
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, wait_up(proc, port)


def ask_serve(url: str, docs: list[str], question: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": DEFAULT_MODEL, "prompt": question, "documents": docs, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_redis_store_shared_with_cachesmith_serve_and_the_fallbacks(pipe, redis_server):
    (d1, d2, d3), question = (documents(i) for i in (30, 31, 32)), QUESTIONS[1]
    context = sum(len(c) for c in pipe.prompt(d1, question).chunk_ids)
    proc, serve_url = serve(redis_server.url)
    try:
        with vllm_server(store_tiers=["redis"], redis_url=redis_server.url) as server:
            url = server.url
            ask_serve(serve_url, d1, question)  # cachesmith serve stores d1's chunks
            from_serve = complete(url, pipe, d1[::-1], question, {"method": "cacheblend@0.15"})
            _, stored_here = complete(url, pipe, d2, question, {"method": "full_reuse"})  # vLLM stores d2's
            hits = samples(serve_url, "cachesmith:store_hits_total").get("redis", 0.0)
            misses = samples(serve_url, "cachesmith:store_misses_total")
            ask_serve(serve_url, d2, question)
            hits_after = samples(serve_url, "cachesmith:store_hits_total").get("redis", 0.0)
            misses_after = samples(serve_url, "cachesmith:store_misses_total")
            generous = complete(url, pipe, d1, question, {"slo_ms": 600_000}, num_tokens=2)[1]
            tight = complete(url, pipe, d1, question, {"slo_ms": 1}, num_tokens=1)[1]  # ends in its first step
            alone = complete(url, pipe, d3, question, None)[0]
            refused = complete(url, pipe, d3, question, {"slo_ms": -5})
            redis_server.stop()  # the only tier: nothing can be stored or read now
            failed = complete(url, pipe, d3, question, {"method": "full_reuse"})
            prompts = samples(url, "cachesmith:vllm_prompts_total")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert (from_serve[1]["num_chunks_stored"], from_serve[1]["num_chunks_prefilled"]) == (3, 0)
    assert from_serve[0] == ours(pipe, d1[::-1], question, "cacheblend@0.15")  # serve's KV, vLLM's decode
    assert stored_here["num_chunks_prefilled"] == 3
    assert hits_after - hits >= 3 and misses_after == misses  # d2's chunks read from redis, none computed
    assert generous["num_recomputed_tokens"] == context and generous["budget_ms"] > 1000
    assert tight["num_recomputed_tokens"] == 0 and tight["budget_ms"] < generous["budget_ms"]
    assert refused[1]["error"] == "cachesmith.slo_ms=-5: must be a positive number and at most 3600000"  # docs/vllm.md
    assert refused[0] == alone  # vLLM alone answered it
    assert failed[1]["fallback"] == "vllm_prefill" and "no store tier took its KV" in failed[1]["error"]
    assert failed[0] == alone  # vLLM prefilled it: its own answer, not a wrong one
    assert prompts == {"built": 4, "rebuilt": 0, "fallback": 1}


# A pool of one block more than two prompts take holds two prompts but not their answers: two
# requests are admitted at once, and one of them is preempted (its blocks freed) when both need a
# block past their prompt's, a few tokens in (the prompts end 3 tokens short of a block); it
# resumes into new blocks once there is room again. Answers ignore EOS: every request grows.
BLOCK_SIZE, PROMPT_BLOCKS, PREEMPT_TOKENS, NUM_LONG = 32, 19, 24, 3


def long_prompt(pipe, i: int) -> PromptParts:
    """Three long documents cut to one length, one question: prompts 3 tokens short of a block."""
    passages = [p for p in load_corpus().passages if len(p.text) >= 1200]
    parts = pipe.prompt([f"{p.title}\n{p.text}" for p in passages[3 * i:3 * i + 3]], QUESTIONS[0])
    context = PROMPT_BLOCKS * BLOCK_SIZE - 3 - len(parts.prefix_ids) - len(parts.suffix_ids)
    sizes = (context // 3, context // 3, context - 2 * (context // 3))
    chunks = [c[:n] for c, n in zip(parts.chunk_ids, sizes)]
    assert [len(c) for c in chunks] == list(sizes)
    return PromptParts(parts.prefix_ids, chunks, parts.suffix_ids)


def at_once(fn, items: list) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("load_async", [False, True])
def test_preempted_requests_are_rebuilt_into_their_new_blocks(pipe, tmp_path, load_async):
    prompts = [long_prompt(pipe, i) for i in range(NUM_LONG)]
    pool = ("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(2 * PROMPT_BLOCKS + 1))
    with vllm_server(*pool, max_model_len=PROMPT_BLOCKS * BLOCK_SIZE + PREEMPT_TOKENS,
                     store_root=str(tmp_path / "kv"), load_async=load_async) as server:
        url = server.url
        alone = [complete_parts(url, pipe, p, None, PREEMPT_TOKENS, ignore_eos=True)[0] for p in prompts]
        before = samples(url, "vllm:num_preemptions_total")  # requests one at a time fit
        plugin = at_once(lambda p: complete_parts(url, pipe, p, {"method": "full_prefill"}, PREEMPT_TOKENS,
                                                  ignore_eos=True), prompts)
        preemptions = sum(samples(url, "vllm:num_preemptions_total").values()) - sum(before.values())
        prompts_total = samples(url, "cachesmith:vllm_prompts_total")
    assert sum(before.values()) == 0  # one request at a time fits: vLLM's reference was never preempted
    assert preemptions > 0  # vLLM really preempted some of the plugin's requests ...
    assert prompts_total["rebuilt"] > 0 and prompts_total["built"] == NUM_LONG and prompts_total["fallback"] == 0
    assert any(r["num_rebuilds"] > 0 for _, r in plugin)  # ... and the connector rebuilt them on resuming
    assert [t for t, _ in plugin] == alone  # every answer is vLLM's own: no resumed request read stale KV


def test_the_plugin_refuses_vllms_prefix_cache():
    # its blocks would be registered as the exact KV of their tokens for every later request
    without = plugin_args(DEFAULT_MODEL)[1:]  # no --no-enable-prefix-caching
    server = VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, extra_args=without)
    with pytest.raises(VllmError, match="exited"):
        with server:
            pass
    assert "CachesmithConnector: launch vLLM with --no-enable-prefix-caching" in server.log.read_text()
