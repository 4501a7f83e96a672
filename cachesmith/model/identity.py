"""A model's identity: what keys its stored chunk KV, its profiles and its cached answers.

In: an HF-format model directory and its parsed `ModelConfig` and transformers config.
Out: a 32-hex-digit identity that only the model's math changes.

Hashed: the config values the decoder computes with (as numbers, never as the file's bytes), the
RoPE parameters, and every weight tensor's name, shape, dtype and sampled rows of its content.
Not hashed: serializer metadata (`transformers_version`, key order, whitespace, `dtype` notes),
tensor order inside a file, how the tensors are split across files, and fields the decoder never
reads. A library upgrade that re-serializes the same weights must not orphan every stored entry
(docs/adr/0011-model-identity.md).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from cachesmith.errors import ModelAssetError
from cachesmith.model.config import ModelConfig
from cachesmith.model.weights import weight_files

IDENTITY_SCHEME = "cachesmith-model/2"
_SAMPLED_ROWS = 8  # rows of a matrix hashed, evenly spaced, first and last included
_SAMPLED_COLUMNS = 2048  # leading columns of each sampled row (and leading elements of a vector)
# ModelConfig fields that change no number a forward pass computes
_NOT_MATH = ("max_positions", "eos_token_ids")


def config_values(config: ModelConfig) -> dict:
    """The decoder's hyper-parameters, normalized: integers and floats as numbers, booleans as such."""
    values = {}
    for name, value in sorted(vars(config).items()):
        if name in _NOT_MATH:
            continue
        values[name] = float(value) if isinstance(value, float) else value
    return values


def rope_values(hf_config) -> dict:
    """The RoPE parameters `model.rope` computes frequencies from, normalized.

    A default RoPE is its base alone; other types hash every parameter, since transformers' init
    functions may read any of them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        return {"rope_type": "default", "rope_theta": float(theta)}
    out = {k: _number(v) for k, v in sorted(params.items()) if k != "type"}
    return {**out, "rope_type": rope_type, "rope_theta": float(theta)}


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)


def _sampled_bytes(handle, name: str) -> tuple[list[int], str, bytes]:
    """(shape, dtype, sampled content) of one stored tensor, read without loading all of it."""
    view = handle.get_slice(name)
    shape, dtype = list(view.get_shape()), str(view.get_dtype())
    if not shape or shape[0] == 0:
        return shape, dtype, b""
    if len(shape) == 1:
        parts = [view[:_SAMPLED_COLUMNS], view[max(0, shape[0] - _SAMPLED_COLUMNS):]]
    else:
        num_rows = shape[0]
        rows = sorted({i * (num_rows - 1) // (_SAMPLED_ROWS - 1) for i in range(_SAMPLED_ROWS)})
        parts = [view[r:r + 1, :_SAMPLED_COLUMNS] for r in rows]
    data = b"".join(p.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for p in parts)
    return shape, dtype, data


def weights_digest(model_dir: Path) -> bytes:
    """sha256 over every tensor's (name, shape, dtype, sampled rows), in name order across files."""
    records: dict[str, tuple[list[int], str, bytes]] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    records[name.removeprefix("model.")] = _sampled_bytes(fh, name)
        except Exception as exc:  # safetensors raises its own types for truncated files
            raise ModelAssetError(f"{path}: cannot be read for the model identity: {exc}") from exc
    digest = hashlib.sha256()
    for name in sorted(records):
        shape, dtype, data = records[name]
        digest.update(json.dumps([name, shape, dtype]).encode() + b"\0")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


def model_identity(model_dir: Path, config: ModelConfig, hf_config) -> str:
    """The identity of the model in `model_dir` (see the module docstring)."""
    head = {"scheme": IDENTITY_SCHEME, "config": config_values(config), "rope": rope_values(hf_config)}
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    digest.update(weights_digest(model_dir))
    return digest.hexdigest()[:32]
