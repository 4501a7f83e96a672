"""Read HF-format safetensors weights into per-layer dicts with a fused QKV matrix.

In: a model directory (config.json + *.safetensors). Out: `ModelWeights` on the requested device and
dtype (the model's identity, which keys stored chunk KV, is `model.identity`'s).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from cachesmith.errors import ModelAssetError
from cachesmith.model.config import ModelConfig

@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor  # [hidden]
    head: torch.Tensor  # [vocab, hidden]


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelAssetError(f"{model_dir} holds no *.safetensors weight file")
    return files


class _Checkpoint:
    """The checkpoint's tensors by name (without the "model." prefix), read one at a time when taken:
    a model loaded onto a GPU never holds a host copy of all its weights at once."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self.model_dir = model_dir
        self._handles: dict[str, tuple[object, str]] = {}  # name -> (open file, its key there)
        for path in weight_files(model_dir):
            try:
                fh = stack.enter_context(safe_open(str(path), framework="pt"))
                self._handles.update((name.removeprefix("model."), (fh, name)) for name in fh.keys())
            except Exception as exc:  # safetensors raises its own error types for truncated files
                raise ModelAssetError(f"{path} is corrupt or truncated: {exc}") from exc

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def take(self, name: str) -> torch.Tensor:
        try:
            fh, key = self._handles.pop(name)
        except KeyError:
            raise ModelAssetError(f"{self.model_dir}: weight {name!r} is missing") from None
        try:
            return fh.get_tensor(key)
        except Exception as exc:
            raise ModelAssetError(f"{self.model_dir}: weight {name!r} is corrupt or truncated: {exc}") from exc


def load_weights(model_dir: Path, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> ModelWeights:
    with ExitStack() as stack:
        return _load(_Checkpoint(model_dir, stack), config, model_dir, device, dtype)


def _load(raw: _Checkpoint, config: ModelConfig, model_dir: Path, device: torch.device,
          dtype: torch.dtype) -> ModelWeights:
    def take(name: str) -> torch.Tensor:
        return raw.take(name).to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layer = {
            "input_norm": take(p + "input_layernorm.weight"),
            "post_norm": take(p + "post_attention_layernorm.weight"),
            "qkv": torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            "o": take(p + "self_attn.o_proj.weight"),
            "gate": take(p + "mlp.gate_proj.weight"),
            "up": take(p + "mlp.up_proj.weight"),
            "down": take(p + "mlp.down_proj.weight"),
        }
        if config.is_qkv_bias:
            layer["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        if config.is_qk_norm:
            layer["q_norm"] = take(p + "self_attn.q_norm.weight")
            layer["k_norm"] = take(p + "self_attn.k_norm.weight")
        layers.append(layer)
    embed = take("embed_tokens.weight")
    head = embed if config.is_tied_embeddings and "lm_head.weight" not in raw else take("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, norm=take("norm.weight"), head=head)
    _check_shapes(weights, config, model_dir)
    return weights


def _check_shapes(w: ModelWeights, cfg: ModelConfig, model_dir: Path) -> None:
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    expected = {
        "embed_tokens": (w.embed.shape, (cfg.vocab_size, cfg.hidden_size)),
        "layers.0 qkv": (w.layers[0]["qkv"].shape, (qkv_rows, cfg.hidden_size)),
        "layers.0 gate": (w.layers[0]["gate"].shape, (cfg.intermediate_size, cfg.hidden_size)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ModelAssetError(f"{model_dir}: weight {name} has shape {tuple(got)}, config says {want}")
