"""Shared fixtures: tiny random-weight HF models saved to disk, and the packaged real model."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import TINY_ARCHITECTURES, save_tiny_model


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_model_dir(request, tmp_path_factory):
    """A tiny random model of each supported architecture, with its HF reference model."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = save_tiny_model(request.param, path)
    return path, hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-only")
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="session")
def real_model():
    """The packaged SmolLM2-135M (fetched on first use) loaded in float32 on CPU."""
    from cachesmith.model import Decoder, Tokenizer, resolve_model

    path = resolve_model("smollm2-135m")
    return Decoder(path, "cpu", torch.float32), Tokenizer(path)
