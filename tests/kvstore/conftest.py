"""Fixtures for store tests: a tiny model and its chunks (redis-server: tests/conftest.py)."""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return Decoder(tiny_llama_dir[0])
