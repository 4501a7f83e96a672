"""A tiny random-weight model that speaks the packaged model's tokenizer, for end-to-end engine
runs in seconds; and short custom workload instances."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model import resolve_model
from cachesmith.pipeline import RagPipeline
from cachesmith.workloads import WorkloadInstance

WORDS = ("river glacier lantern harbor meadow falcon copper amber silent frozen canyon velvet granite "
         "orchard beacon summit").split()


def save_tiny_chat_model(path: Path, num_layers: int = 4, seed: int = 0, max_positions: int = 1024,
                         weight_std: float | None = None) -> Path:
    """`weight_std`: redraw every matrix with this spread (transformers' default init gives
    near-uniform logits, whose greedy tokens say little about the math that made them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).float().eval()
    if weight_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0, weight_std)
    model.save_pretrained(str(path))
    # `make test-cuda` names the GPU kit's copy of the tokenizer (a GPU machine may not fetch the model)
    real = Path(os.environ.get("CACHESMITH_TEST_TOKENIZER") or resolve_model("smollm2-135m"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, path / name)
    return path


def tiny_pipeline(model_dir: Path, kv_root: Path) -> RagPipeline:
    return RagPipeline(str(model_dir), store=ChunkStore(StoreConfig(tiers=("memory",), root=kv_root)))


def instance(seed: int, num_docs: int = 3, words_per_doc: int = 40) -> WorkloadInstance:
    docs = tuple(" ".join(WORDS[(seed * 7 + d * 3 + i) % len(WORDS)] for i in range(words_per_doc)) + f" {seed}-{d}."
                 for d in range(num_docs))
    return WorkloadInstance("custom", docs, f"Which word comes after river in passage {seed}?", ("glacier",),
                            max_new_tokens=3, metadata={"seed": seed})
