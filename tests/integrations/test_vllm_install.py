"""vLLM's venv (`benchmarks/vllm_server.py`) gets, beside vLLM, the versions cachesmith pins (the
lock; torch by the Makefile's pin, which the lock leaves out): the plugin runs cachesmith's code on
them inside vLLM's worker."""
from __future__ import annotations

import re
from pathlib import Path

from benchmarks import vllm_server

REPO = Path(__file__).resolve().parents[2]


def test_the_vllm_venv_pins_what_the_lock_pins():
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\]+)", (REPO / "requirements.lock").read_text(), re.M))
    lock.update(re.findall(r"^TORCH := (torch)==(\S+)", (REPO / "Makefile").read_text(), re.M))
    pins = [*vllm_server.CACHESMITH_EXTRAS, vllm_server.TORCH]
    for pin in pins:
        name, version = pin.split("==")
        assert lock.get(name) == version, f"{pin}: the lock pins {name}=={lock.get(name)}"
    assert {p.split("==")[0] for p in pins} >= {"redis", "xxhash", "gguf", "torch"}
