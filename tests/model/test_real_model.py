"""A few checks on the packaged SmolLM2-135M (fetched by `make test` before pytest runs)."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model import assets, greedy_decode

pytestmark = pytest.mark.real_model

FILLER = [
    "The Amazon rainforest covers most of the Amazon basin of South America. The basin spans seven "
    "million square kilometres, of which five and a half million are covered by the rainforest.",
    "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur Himal "
    "sub-range of the Himalayas. The China-Nepal border runs across its summit point.",
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres.",
]


def test_fetch_is_idempotent_and_complete(real_model):
    path = assets.fetch("smollm2-135m")
    assert assets.is_complete(path)
    assert assets.fetch("smollm2-135m") == path
    model, _ = real_model
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.is_tied_embeddings and cfg.max_positions == 8192


def test_single_needle_answered_with_full_prefill(real_model):
    model, tok = real_model
    docs = [FILLER[0], "One of the special magic numbers for quiet-harbor is: 4829173.", FILLER[1], FILLER[2]]
    parts = tok.rag_prompt_parts(docs, "What is the special magic number for quiet-harbor? "
                                       "Answer with the number only.")
    logits, cache = model.prefill(parts.token_ids, extra_capacity=24)
    answer = tok.decode(greedy_decode(model, logits, cache, max_new_tokens=24))
    assert "4829173" in answer


def test_logits_match_transformers_on_real_model(real_model):
    from transformers import AutoModelForCausalLM

    model, tok = real_model
    hf = AutoModelForCausalLM.from_pretrained(str(model.model_dir), dtype=torch.float32).eval()
    ids = tok.encode(" ".join(FILLER))
    logits, _ = model.prefill(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert (logits - ref).abs().max().item() < 1e-4


def test_rag_prompt_parts_concatenate_to_the_chat_prompt(real_model):
    _, tok = real_model
    parts = tok.rag_prompt_parts(FILLER[:2], "Which mountain is highest?")
    text = tok.hf.decode(parts.token_ids)
    expected = tok.chat_text([{"role": "user", "content": FILLER[0] + "\n\n" + FILLER[1] + "\n\n"
                               + "Which mountain is highest?"}])
    assert text == expected
    assert len(parts.chunk_ids) == 2 and all(parts.chunk_ids)
