"""A random-weight model in a named shape, written as an HF-format folder: the model the GPU check
(benchmarks/gpu_check.py) runs our `Decoder`, transformers' `AutoModelForCausalLM` and
`cachesmith serve` on. Our loader and the model identity read the weights from files, so the
folder cannot be skipped.

In: a shape name (SHAPES: `tiny`, a CPU dry run; `1b`, Llama-3.2-1B's layers; `8b`, Llama-3-8B's),
the device and dtype to draw the weights in, and a tokenizer folder (`default_tokenizer_dir`: the
packaged smollm2-135m one where it was fetched; nothing is fetched here) whose vocabulary size and
special ids the config takes (49,152, 1 and 2 without one).
Out: `build_model`: the folder `random-<shape>` under the given work folder (config.json,
model.safetensors, the tokenizer's files in TOKENIZER_FILES) and what building it took (config,
weights_gb, build_s, save_s). Weights: std INIT_STD (0.02), norms 1, drawn on the device in the
target dtype from seed 0 (no CPU round trip). `weight_bytes` is their size before drawing them and
`scratch_root` where the work folder fits: /dev/shm where it holds them twice over, else None (the
default temp dir).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from cachesmith.model import DEFAULT_MODEL
from cachesmith.model.assets import is_complete, models_root
from cachesmith.model.device import synchronize
from cachesmith.testing import sim_cuda
from benchmarks.common.hf_compat import rope_kwargs

INIT_STD = 0.02  # the Llama family's initializer range
ROPE_THETA = 500000.0  # Llama 3's base
SHAPES = {  # the named model's sizes (vocabulary: the tokenizer's)
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def config_fields(shape: str, tokenizer_dir: Path | None) -> dict:
    """The named shape's config fields, its vocabulary and special ids the tokenizer's, RoPE in both
    transformers spellings (`hf_compat.rope_kwargs`: 4.x and 5.x then agree with our loader).
    Plain values: sizing the weights needs no transformers."""
    tok = json.loads((tokenizer_dir / "config.json").read_text()) if tokenizer_dir and \
        (tokenizer_dir / "config.json").is_file() else {}
    return dict(**SHAPES[shape], vocab_size=tok.get("vocab_size", 49152), rms_norm_eps=1e-5,
                max_position_embeddings=32768, bos_token_id=tok.get("bos_token_id", 1),
                eos_token_id=tok.get("eos_token_id", 2), **rope_kwargs(ROPE_THETA))


def llama_config(shape: str, tokenizer_dir: Path | None):
    """A LlamaConfig of the named shape (`config_fields`)."""
    from transformers import LlamaConfig

    return LlamaConfig(**config_fields(shape, tokenizer_dir))


def generator_device(device: torch.device) -> torch.device:
    """Where the weights' generator lives: the device, except on the simulated one, whose data is
    the CPU's (a `cuda` generator needs a CUDA build of torch)."""
    return torch.device("cpu") if sim_cuda.active() is not None else device


def random_weights(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights drawn on the device in `dtype` (no CPU round trip: 8B takes a second)."""
    g = torch.Generator(device=generator_device(device)).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(INIT_STD)

    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {"model.embed_tokens.weight": normal(cfg.vocab_size, h),
           "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
                    p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
                    p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
                    p + "mlp.down_proj.weight": normal(h, inter)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = normal(cfg.vocab_size, h)
    return out


def scratch_root(num_bytes: int) -> str | None:
    """/dev/shm where it holds the weights twice over (no disk write), else the default temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * num_bytes:
        return str(shm)
    return None


def write_model(cfg, weights: dict[str, torch.Tensor], tokenizer_dir: Path | None, model_dir: Path) -> None:
    """config.json, model.safetensors and the tokenizer's files: a folder every loader reads."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True)
    cfg.save_pretrained(str(model_dir))
    # safetensors writes host bytes: copied here in one pass, not read from device storage by it
    host = {name: w.cpu() for name, w in weights.items()}
    save_file(host, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, model_dir / name)


def build_model(args, work: Path, device: torch.device, dtype: torch.dtype) -> tuple[Path, dict]:
    """The random model's folder under `work`, and what building it took."""
    cfg = llama_config(args.shape, args.tokenizer_dir)
    start = time.perf_counter()
    weights = random_weights(cfg, device, dtype)
    synchronize(device)  # the draws are queued on a GPU: build_s is their time, not their launch
    built = time.perf_counter()
    write_model(cfg, weights, args.tokenizer_dir, work / f"random-{args.shape}")
    num_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    del weights
    info = {"config": {**SHAPES[args.shape], "vocab_size": cfg.vocab_size, "rope_theta": ROPE_THETA,
                       "max_position_embeddings": cfg.max_position_embeddings},
            "weights_gb": num_bytes / 1e9, "build_s": built - start, "save_s": time.perf_counter() - built,
            "folder": str(work)}
    return work / f"random-{args.shape}", info


def weight_bytes(fields: dict, dtype: torch.dtype) -> int:
    """What the weights of a config (`config_fields`) take in `dtype` (where to write them depends on it)."""
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    kv = fields["num_key_value_heads"] * h // fields["num_attention_heads"]
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * inter
    embeds = (1 if fields["tie_word_embeddings"] else 2) * fields["vocab_size"] * h
    return (fields["num_hidden_layers"] * per_layer + embeds) * torch.empty(0, dtype=dtype).element_size()


def default_tokenizer_dir() -> Path | None:
    """The packaged model's folder where it was fetched (nothing is fetched here: a GPU machine
    may have no network; there, pass a carried copy)."""
    path = models_root() / DEFAULT_MODEL
    return path if is_complete(path) else None
