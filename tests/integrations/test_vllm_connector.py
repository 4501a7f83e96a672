"""cachesmith inside vLLM (`cachesmith.integrations.vllm_connector`), on vLLM's CPU build and the
packaged model in float32, 20 RAG prompts, 32 greedy tokens each: at full coverage the plugin gives
exactly vLLM's own tokens; with full reuse and CacheBlend@15% it gives exactly the tokens
cachesmith's own engine gives with the same plan, and full reuse answers differently from vLLM
alone somewhere (the KV vLLM decodes from really is cachesmith's). Runs only under `make test-vllm`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.methods import parse_method
from cachesmith.model.assets import DEFAULT_MODEL, resolve_model
from cachesmith.pipeline import RagPipeline
from cachesmith.workloads.corpus import load_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]
NUM_REQUESTS, NUM_TOKENS = 20, 32
QUESTIONS = ("Which of these articles is the longest?", "Name one place mentioned above.",
             "Summarize the second document in one sentence.", "What year appears first?")
METHODS = ("full_prefill", "full_reuse", "cacheblend@0.15")
CONNECTOR = json.dumps({"kv_connector": "CachesmithConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "cachesmith.integrations.vllm_connector",
                        "kv_connector_extra_config": {"model": DEFAULT_MODEL}})


def _complete(url: str, ids: list[int], params: dict | None) -> list[int]:
    body = {"model": DEFAULT_MODEL, "prompt": ids, "max_tokens": NUM_TOKENS, "temperature": 0.0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = {"cachesmith": params}
    r = httpx.post(f"{url}/v1/completions", timeout=600, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_the_plugin_answers_as_cachesmith_with_each_plan():
    pipe = RagPipeline(DEFAULT_MODEL, store=ChunkStore(StoreConfig(tiers=("memory",))))
    eos = pipe.tokenizer.hf.eos_token_id
    strip = lambda t: list(t[:-1] if t and t[-1] == eos else t)  # noqa: E731  (EOS reported by one side only)
    passages = load_corpus().passages
    requests = [([f"{p.title}\n{p.text}"[:1200] for p in passages[3 * i:3 * i + 3]], QUESTIONS[i % len(QUESTIONS)])
                for i in range(NUM_REQUESTS)]
    parts = [pipe.prompt(docs, question) for docs, question in requests]
    ours = {m: [strip(pipe.answer(d, q, parse_method(m).plan(pipe.model.num_layers), NUM_TOKENS).token_ids)
                for d, q in requests] for m in METHODS}
    with VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL,
                    extra_args=("--no-enable-prefix-caching", "--kv-transfer-config", CONNECTOR)) as server:
        theirs = [strip(_complete(server.url, p.token_ids, None)) for p in parts]
        plugin = {m: [strip(_complete(server.url, p.token_ids, {
            "num_prefix_tokens": len(p.prefix_ids), "chunk_token_counts": [len(c) for c in p.chunk_ids],
            "method": m})) for p in parts] for m in METHODS}
    assert plugin["full_prefill"] == theirs  # r = 100%: vLLM's own tokens
    for m in METHODS:
        assert plugin[m] == ours[m], m  # cachesmith's engine's tokens with the same plan
    assert plugin["full_reuse"] != theirs  # the reused KV is what vLLM decoded from
