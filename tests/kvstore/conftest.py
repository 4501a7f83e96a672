"""Fixtures for store tests: a tiny model on each device a test should pass on (redis-server:
tests/conftest.py)."""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder
from tests.conftest import DEVICES


@pytest.fixture(scope="module", params=DEVICES)
def model(tiny_llama_dir, request):
    return Decoder(tiny_llama_dir[0], request.param)
