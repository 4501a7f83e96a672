"""The CLI's device paths on the simulated CUDA device: `ask`, `precompute`, `profile --costs-only`
at its smallest grid and a short `bench`, each with `--device cuda`, answering as on the CPU where the
math decides the answer."""
from __future__ import annotations

import json
import re

import pytest

from cachesmith import cli
from tests.engine_helpers import WORDS, save_tiny_chat_model
from tests.planner.synthetic_profile import make_profile
from tests.workloads.test_cli import _corpus_file

pytestmark = [pytest.mark.real_model, pytest.mark.sim_cuda]  # the tiny model borrows the packaged tokenizer

QUESTION = "Which word comes after river?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-cli"), weight_std=0.1, max_positions=4096)


def docs(tmp_path) -> list[str]:
    args = []
    for d in range(3):
        path = tmp_path / f"d{d}.txt"
        path.write_text(" ".join(WORDS[(d * 3 + i) % len(WORDS)] for i in range(50)) + ".")
        args += ["--doc", str(path)]
    return args


def ask(model_dir, tmp_path, device: str, capsys) -> str:
    argv = ["ask", "--model", str(model_dir), "--device", device, *docs(tmp_path), "--question", QUESTION,
            "--max-new-tokens", "6", "--method", "cacheblend@0.15"]
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_ask_answers_on_the_simulated_gpu_as_on_the_cpu(model_dir, tmp_path, capsys, sim_cuda):
    with sim_cuda.count() as counts:
        on_device = ask(model_dir, tmp_path, "cuda", capsys)
    assert counts.ops > 0 and counts.findings == []
    assert on_device.strip() and on_device == ask(model_dir, tmp_path, "cpu", capsys)


def test_precompute_stores_the_keys_the_cpu_stores(model_dir, tmp_path, capsys, sim_cuda):
    corpus = _corpus_file(tmp_path)
    keys = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / f"keys-{device}.txt"
        with sim_cuda.count() as counts:
            assert cli.main(["precompute", str(corpus), "--model", str(model_dir), "--device", device, "--tiers",
                             "disk", "--store-root", str(tmp_path / f"kv-{device}"), "--keys-out", str(out)]) == 0
        assert counts.findings == []
        keys[device] = out.read_text().split()
    assert len(keys["cuda"]) == 40 and keys["cuda"] == keys["cpu"]
    assert "40 passages: 40 computed" in capsys.readouterr().out


def test_profile_costs_only_at_its_smallest_grid(model_dir, tmp_path, capsys, sim_cuda):
    out = tmp_path / "profile.json"
    with sim_cuda.count() as counts:
        assert cli.main(["profile", "--model", str(model_dir), "--device", "cuda", "--costs-only", "--max-tokens",
                         "512", "--num-shapes", "3", "--plans-per-shape", "2", "--tiers", "memory", "--out",
                         str(out)]) == 0
    assert counts.findings == []
    profile = json.loads(out.read_text())
    assert profile["device"] == "cuda" and profile["layer_costs"]


def test_a_short_bench(model_dir, tmp_path, capsys, sim_cuda):
    from dataclasses import replace

    from cachesmith.model import Decoder

    fingerprint = Decoder(model_dir, "cpu").fingerprint
    profile = tmp_path / "profile.json"
    replace(make_profile(num_layers=4), model_fingerprint=fingerprint, device="cuda").save(profile)
    work = tmp_path / "w.jsonl"
    assert cli.main(["workload", "export", "--task", "mix", "--num-instances", "2", "--out", str(work),
                     "--corpus", str(_corpus_file(tmp_path))]) == 0
    with sim_cuda.count() as counts:
        rc = cli.main(["bench", "--model", str(model_dir), "--device", "cuda", "--workload", str(work),
                       "--num-requests", "2", "--methods", "full_reuse", "cacheblend@0.15", "--base-samples", "1",
                       "--tiers", "memory", "--profile", str(profile), "--out", str(tmp_path / "bench")])
    assert counts.findings == []
    printed = capsys.readouterr()
    assert rc == 0 and re.search(r"\| full_reuse \|", printed.out), printed.err[-2000:]
    records = json.loads((tmp_path / "bench" / "summary.json").read_text())["records"]
    assert len(records) == 4 and [r["error"] for r in records] == [None] * 4, records
    assert all(r["ttft_s"] > 0 for r in records)
