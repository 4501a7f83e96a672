"""The published OpenAPI schema is what the server does: schemathesis (`run --checks all`, every
phase, stateful links included) against a live server finds nothing, and its fuzzing reaches the
engine (completions with documents are served, not only refused)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachesmith.server import ServerConfig
from cachesmith.server.run import BackgroundServer
from tests.engine_helpers import save_tiny_chat_model
from tests.server.conftest import make_service

CLI = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the real model's 8192 positions: a prompt past the model's positions is a 400 no schema can state
    # (it counts tokens), and the fuzzer's longest bodies fit in 8192 but not in the tiny default 1024
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-8k"), num_layers=2, max_positions=8192)
    with BackgroundServer(make_service(model_dir), ServerConfig(port=0, log_level="error")) as srv:
        yield srv


def test_schemathesis_finds_no_mismatch_and_reaches_the_engine(server, tmp_path):
    cli = str(CLI) if CLI.exists() else shutil.which("schemathesis")  # the test extra installs it
    assert cli, "schemathesis is missing: pip install -e .[test]"
    run = subprocess.run([cli, "run", server.url + "/openapi.json", "--checks", "all", "--max-examples", "25",
                          "--seed", "7", "--no-color"], cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-6000:]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    samples = [s for fam in text_string_to_metric_families(metrics) for s in fam.samples]
    served = sum(s.value for s in samples if s.name == "cachesmith:requests_served_total")
    # schema-valid completions were answered by the engine, or priced against its queue and refused
    # as unable to meet their (fuzzed, often tiny) SLO
    shed = sum(s.value for s in samples if s.name == "cachesmith:requests_shed_total")
    assert served >= 5 and served + shed >= 10, (served, shed)
