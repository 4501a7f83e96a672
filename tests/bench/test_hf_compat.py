"""The GPU check's models under whichever transformers is installed (issue 77): the random model's
config and the tiny test models give transformers' model and our loader one RoPE base (4.x reads
`rope_theta`, 5.x `rope_parameters`, ours `rope_parameters` first), `from_pretrained`'s dtype and
the last-logits argument are spelled as the installed version spells them, and the check's
versions and rows survive a Python without transformers."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.common import hf_compat
from benchmarks.common.random_model import ROPE_THETA, SHAPES, llama_config
from cachesmith.model.config import load_hf_config
from cachesmith.model.rope import RotaryEmbedding
from tests.tiny_models import TINY_ARCHITECTURES

REPO = Path(__file__).resolve().parents[2]

CPU = torch.device("cpu")
TINY_THETAS = {"llama": 1e4, "qwen3": 1e6, "qwen2": 1e6, "mistral": 1e6}


def theirs(hf_config) -> torch.Tensor:
    """The inverse frequencies transformers' Llama model computes from the config."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config=hf_config).inv_freq


def ours(hf_config) -> torch.Tensor:
    return RotaryEmbedding(hf_config, CPU, torch.float32).inv_freq


def base_of(inv_freq: torch.Tensor, head_dim: int) -> float:
    """The RoPE base behind inverse frequencies: inv_freq[1] = base ** (-2 / head_dim)."""
    return float(inv_freq[1].double() ** (-head_dim / 2))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_random_model_gives_transformers_and_our_loader_one_rope_base(shape, tmp_path):
    cfg = llama_config(shape, None)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert base_of(theirs(cfg), head_dim) == pytest.approx(ROPE_THETA, rel=1e-4)
    assert torch.allclose(ours(cfg), theirs(cfg))
    cfg.save_pretrained(str(tmp_path))  # what both loaders read in the check: config.json
    loaded = load_hf_config(tmp_path)
    assert torch.allclose(ours(loaded), theirs(loaded))
    assert base_of(ours(loaded), head_dim) == pytest.approx(ROPE_THETA, rel=1e-4)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_each_tiny_model_gives_transformers_and_our_loader_one_rope_base(arch, tmp_path):
    model = TINY_ARCHITECTURES[arch]()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert base_of(model.model.rotary_emb.inv_freq, head_dim) == pytest.approx(TINY_THETAS[arch], rel=1e-4)
    assert torch.allclose(ours(model.config), model.model.rotary_emb.inv_freq)
    model.config.save_pretrained(str(tmp_path))
    assert torch.allclose(ours(load_hf_config(tmp_path)), model.model.rotary_emb.inv_freq)


@pytest.mark.parametrize(("installed", "spelling"), [((4, 45), "torch_dtype"), ((4, 55), "torch_dtype"),
                                                     ((4, 56), "dtype"), ((5, 25), "dtype")])
def test_the_dtype_argument_is_spelled_as_the_installed_transformers_spells_it(monkeypatch, installed, spelling):
    monkeypatch.setattr(hf_compat, "transformers_version", lambda: installed)
    assert hf_compat.dtype_kwargs(torch.bfloat16) == {spelling: torch.bfloat16}


def test_the_installed_transformers_takes_the_dtype_spelling_chosen(tmp_path):
    from transformers import AutoModelForCausalLM

    llama_config("tiny", None).save_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_config(load_hf_config(tmp_path))
    model.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), **hf_compat.dtype_kwargs(torch.bfloat16))
    assert next(loaded.parameters()).dtype == torch.bfloat16


class _Keeps:
    def forward(self, input_ids, logits_to_keep=0): ...


class _KeepsNum:
    def forward(self, input_ids, num_logits_to_keep=0): ...


class _KeepsAll:
    def forward(self, input_ids, attention_mask=None): ...


def test_the_last_logits_argument_is_the_one_the_forward_takes():
    assert hf_compat.last_logits_kwargs(_Keeps()) == {"logits_to_keep": 1}
    assert hf_compat.last_logits_kwargs(_KeepsNum()) == {"num_logits_to_keep": 1}
    assert hf_compat.last_logits_kwargs(_KeepsAll()) == {}


def test_the_check_reads_the_last_logits_of_transformers_model(tmp_path):
    """`gpu_check.last_logits` on the installed transformers: the full forward's last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(llama_config("tiny", None)).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(gpu_check.last_logits(model, ids), model(ids).logits[:, -1], atol=1e-5)


def test_versions_report_a_missing_package_as_none(monkeypatch):
    real = gpu_check.version

    def version(name: str) -> str:
        if name == "transformers":
            raise PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(gpu_check, "version", version)
    got = gpu_check.versions(CPU)
    assert got["transformers"] is None and got["torch"] == torch.__version__ and got["tokenizers"]


def test_a_python_without_transformers_still_writes_the_rows(tmp_path):
    """transformers made unimportable: the build row says why, and the payload is written."""
    out = tmp_path / "gpu_check.json"
    code = ("import runpy, sys; sys.modules['transformers'] = None; "
            f"sys.argv = ['gpu_check.py', '--shape', 'tiny', '--device', 'cpu', '--skip-serve', '--out', {str(out)!r}, "
            "'--max-minutes', '1']; runpy.run_module('benchmarks.gpu_check', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and out.is_file(), proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    build = payload["rows"][0]
    assert (build["leg"], build["case"]) == ("setup", "build") and "transformers" in build["error"]
    assert payload["versions"]["torch"] == torch.__version__ and not payload["passed"]
