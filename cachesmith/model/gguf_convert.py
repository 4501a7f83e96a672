"""Convert a llama.cpp GGUF file (Llama architecture) into an HF-format directory.

In: a `.gguf` path. Out: `model.safetensors` (dequantized, float32), `config.json` and the
tokenizer files in `out_dir`. llama.cpp permutes the rows of Q and K for its RoPE layout; we undo it
so that the weights equal what transformers' own GGUF loader produces (checked once, see decisions).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cachesmith.errors import ModelAssetError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (interleaved -> half-split rotary layout)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def read_llama_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelAssetError(f"GGUF general.architecture={arch!r}: only 'llama' files convert")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: Path, out_dir: Path, show_progress: bool = True) -> None:
    """Write model.safetensors + config.json + tokenizer files for `gguf_path` into `out_dir`."""
    import gguf
    from transformers import AutoTokenizer, LlamaConfig

    reader = gguf.GGUFReader(str(gguf_path))
    raw = read_llama_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not show_progress):
        weight = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rows(weight, raw["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rows(weight, raw["num_key_value_heads"])
        tensors[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(weight))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    theta = raw.pop("rope_theta")
    config = LlamaConfig(**raw, rope_parameters={"rope_type": "default", "rope_theta": theta})
    config.save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
