"""`benchmarks.gpu_check` on the simulated CUDA device at its tiny shape, run as `make gpu-check`
runs it (a subprocess, the serve leg's server a simulated child of its own): every leg writes its
rows without an error, the payload has the schema a GPU run writes, and the server answered. Graph
decode replayed and gave eager decode's tokens, and every phase's attention calls were seen and got
a fused kernel, as the simulation decides torch's CUDA checks would (`sim_kernels`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.common.serve_leg import NUM_RAG
from benchmarks.common.reuse_rows import METHODS
from benchmarks.gpu_check import SIZES
from cachesmith.model import resolve_model
from cachesmith.testing.sim_backend import SimBackend
from cachesmith.testing.sim_cuda import SimCuda

pytestmark = [pytest.mark.real_model, pytest.mark.sim_cuda]  # the served requests use the packaged tokenizer

REPO = Path(__file__).resolve().parents[2]

TINY = SIZES["tiny"]
PAYLOAD_KEYS = {"shape", "device", "dtype", "contexts", "versions", "tokenizer_dir", "setup", "rows", "bars",
                "passed", "command", "commit", "date", "machine"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    cmd = [sys.executable, "-m", "cachesmith.testing.sim_run", "benchmarks.gpu_check", "--shape", "tiny",
           "--device", "cuda", "--tokenizer-dir", str(resolve_model("smollm2-135m")), "--out", str(out),
           "--max-minutes", "2", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.is_file(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def cases(payload: dict, leg: str) -> list[str]:
    return [r["case"] for r in payload["rows"] if r["leg"] == leg]


def test_every_row_ran_and_every_bar_passed(run):
    proc, payload = run
    broken = [r for r in payload["rows"] if "error" in r or "skipped" in r]
    assert broken == [], proc.stderr[-3000:]
    assert [b["passed"] for b in payload["bars"]] == [True] * 5, payload["bars"]  # the device's two too
    assert payload["passed"] and proc.returncode == 0
    assert "simulated cuda:" in proc.stderr  # the check itself ran on the simulation


def test_the_payload_has_a_gpu_runs_schema(run):
    _, payload = run
    assert PAYLOAD_KEYS <= set(payload)
    sim_name = SimBackend(SimCuda()).name(torch.device("cuda"))
    assert payload["versions"]["gpu"] == sim_name and payload["device"] == "cuda"
    assert payload["contexts"] == list(TINY.contexts)
    assert cases(payload, "logits") == [f"{TINY.short}"]
    assert cases(payload, "prefill") == [f"{c}" for c in TINY.contexts]
    assert cases(payload, "reuse") == [f"{m} {c} {path}" for c in TINY.contexts for m in METHODS
                                       for path in ("direct", "store")]
    assert cases(payload, "batch") == [f"{TINY.batch}x{TINY.short} cacheblend@0.15"]
    assert cases(payload, "decode") == [f"{s} stream(s) {TINY.short}" for s in TINY.streams]
    assert len(cases(payload, "serve")) == 1
    assert cases(payload, "graphs") == [f"{max(TINY.streams)} stream(s) {TINY.short}"]
    assert {"transformers", "tokenizers", "huggingface-hub"} <= set(payload["versions"])


def test_graph_decode_replayed_and_gave_eager_decodes_tokens(run):
    _, payload = run
    graphs = next(r for r in payload["rows"] if r["leg"] == "graphs")
    assert graphs["tokens_equal"] and graphs["graph_replays"] == TINY.new_tokens - 1
    assert graphs["dtype"] == payload["dtype"] == "bfloat16"


def test_each_phases_attention_calls_got_a_fused_kernel(run):
    """Every phase's calls were seen (the graph's at its capture too), and each kind got the fused
    kernel the simulation decides as torch's CUDA checks would (`sim_kernels`), with the flags."""
    _, payload = run
    kernels = [r for r in payload["rows"] if r["leg"] == "kernels"]
    assert {r["case"].split(" q[")[0] for r in kernels} == {"prefill", "recompute", "decode eager", "decode graph"}
    for row in kernels:
        assert row["passed"] and "math" not in row["picked"] and row["calls"] >= row["signatures"] >= 1, row
        assert all(isinstance(row[k], bool) for k in ("flash", "efficient", "cudnn")) and row[row["picked"][0]]


def test_the_store_path_gives_the_direct_paths_logits(run):
    _, payload = run
    staged = [r for r in payload["rows"] if r["leg"] == "reuse" and r.get("path") == "store"]
    assert staged and all(r["logit_diff_vs_direct"] == 0.0 for r in staged)


def test_the_simulated_server_answered_every_request(run):
    _, payload = run
    serve = next(r for r in payload["rows"] if r["leg"] == "serve")
    assert [a["status"] for a in serve["rag"]] == [200] * NUM_RAG
    assert serve["answered_with_plan"] == NUM_RAG and serve["chat"]["status"] == 200
