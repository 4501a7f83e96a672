"""Architecture hyper-parameters of a decoder, read from an HF-format model directory.

In: a directory with `config.json` (Llama, Mistral, SmolLM, Qwen2, Qwen3).
Out: a frozen `ModelConfig`, plus the transformers config object (kept only for RoPE set-up).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cachesmith.errors import ModelAssetError

# model_type -> (has q/k RMSNorm, default qkv bias)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (False, True),
    "qwen3": (True, False),
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    is_tied_embeddings: bool
    is_qkv_bias: bool
    is_qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_positions"):
            if getattr(self, name) <= 0:
                raise ModelAssetError(f"config field {name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelAssetError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def num_layer_parameters(self) -> int:
        """Parameters of one decoder layer: its matrices, biases and norms."""
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return (qkv_rows * self.hidden_size + self.num_heads * self.head_dim * self.hidden_size
                + 3 * self.intermediate_size * self.hidden_size + 2 * self.hidden_size
                + (qkv_rows if self.is_qkv_bias else 0) + (2 * self.head_dim if self.is_qk_norm else 0))

    @staticmethod
    def from_hf(hf_config) -> "ModelConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelAssetError(
                f"config.json model_type={model_type!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        is_qk_norm, default_bias = SUPPORTED_ARCHITECTURES[model_type]
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return ModelConfig(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_positions=hf_config.max_position_embeddings,
            is_tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            is_qkv_bias=bool(getattr(hf_config, "attention_bias", default_bias)),
            is_qk_norm=is_qk_norm,
            eos_token_ids=eos_ids,
        )


def load_hf_config(model_dir: Path):
    """Read config.json with transformers, turning every failure into a message that names the file."""
    from transformers import AutoConfig

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ModelAssetError(f"{config_path} is missing: not an HF-format model directory")
    try:
        json.loads(config_path.read_text())
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelAssetError(f"{config_path} cannot be read: {exc}") from exc
