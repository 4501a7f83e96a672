"""Tiny random-weight HF models for exactness tests (built in the test run, never downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False)


def rope(theta: float) -> dict:
    """A default RoPE's base in both transformers spellings: 5.x reads `rope_parameters`, 4.x
    `rope_theta` (keeping `rope_parameters` as an attribute, which our loader reads first). One
    alone would give transformers' model and ours different bases on one of them."""
    return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_COMMON, **rope(10000.0)))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16, **rope(1e6)))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, **rope(1e6)))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None, **rope(1e6)))


TINY_ARCHITECTURES = {"llama": _llama, "qwen3": _qwen3, "qwen2": _qwen2, "mistral": _mistral}


def save_tiny_model(arch: str, path: Path, seed: int = 0):
    """Build, randomize (norm weights too, so q/k-norm bugs show) and save; return the HF model."""
    torch.manual_seed(seed)
    model = TINY_ARCHITECTURES[arch]().float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    model.config._attn_implementation = "eager"
    model.save_pretrained(str(path))
    return model
