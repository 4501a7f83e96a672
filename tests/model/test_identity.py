"""The model identity changes with the model's math and with nothing else: not with the library
version a converter writes, key order, whitespace, tensor order or sharding."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachesmith.model.config import ModelConfig, load_hf_config
from cachesmith.model.identity import model_identity
from tests.tiny_models import save_tiny_model


def _identity(model_dir: Path) -> str:
    hf = load_hf_config(model_dir)
    return model_identity(model_dir, ModelConfig.from_hf(hf), hf)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("identity") / "base"
    save_tiny_model("llama", path)
    return path


def _copy(base: Path, tmp_path: Path, name: str = "copy") -> Path:
    out = tmp_path / name
    shutil.copytree(base, out)
    return out


def _edit_config(model_dir: Path, edit, indent=2, sort_keys=False) -> None:
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys))


def _weights_file(model_dir: Path) -> Path:
    (path,) = model_dir.glob("*.safetensors")
    return path


def test_serializer_metadata_and_layout_do_not_change_the_identity(base, tmp_path):
    want = _identity(base)
    # another library version, reversed key order, other whitespace
    other = _copy(base, tmp_path)
    _edit_config(other, lambda d: d.update(transformers_version="9.99.0"), indent=None)
    data = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(reversed(list(data.items())))))
    # the same tensors re-saved in another order and split over two files, with other metadata
    tensors = load_file(_weights_file(other))
    _weights_file(other).unlink()
    names = sorted(tensors, reverse=True)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(other / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt", "writer": "another"})
    save_file({n: tensors[n] for n in names[half:]}, str(other / "model-00002-of-00002.safetensors"))
    assert _identity(other) == want


@pytest.mark.parametrize("edit", [
    lambda d: d["rope_parameters"].update(rope_theta=20000.0),
    lambda d: d.update(rms_norm_eps=1e-5),
    lambda d: d.update(num_hidden_layers=2),
    lambda d: d.update(num_key_value_heads=4),
], ids=["rope_theta", "rms_norm_eps", "num_layers", "num_kv_heads"])
def test_a_changed_config_value_changes_the_identity(base, tmp_path, edit):
    other = _copy(base, tmp_path)
    _edit_config(other, edit)
    assert _identity(other) != _identity(base)


@pytest.mark.parametrize("name, change", [
    ("model.layers.1.self_attn.o_proj.weight", lambda t: t * 1.001),
    ("model.layers.2.post_attention_layernorm.weight", lambda t: t + 1e-3),
    ("model.embed_tokens.weight", lambda t: t.to(torch.bfloat16)),
], ids=["scaled_weight", "shifted_norm", "other_dtype"])
def test_a_changed_weight_changes_the_identity(base, tmp_path, name, change):
    other = _copy(base, tmp_path)
    tensors = load_file(_weights_file(other))
    assert name in tensors
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(_weights_file(other)), metadata={"format": "pt"})
    assert _identity(other) != _identity(base)


def test_fields_the_decoder_never_reads_leave_the_identity(base, tmp_path):
    other = _copy(base, tmp_path)
    _edit_config(other, lambda d: d.update(initializer_range=0.5, use_cache=False, eos_token_id=7,
                                           max_position_embeddings=512))
    assert _identity(other) == _identity(base)


def test_the_decoder_is_keyed_by_the_identity(base):
    from cachesmith.model.decoder import Decoder

    assert Decoder(base).fingerprint == _identity(base)
