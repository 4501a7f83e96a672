"""The examples of the README, docs/serving.md and docs/vllm.md, run as written.

Every fenced block of those files says what it is in its info string (```sh example:KIND):
- `run`: run here, in order, against a `cachesmith serve` this test starts on the packaged model
  (shell blocks with bash, Python blocks with this Python; the port 8000 they name becomes the
  server's, `.venv/bin/` this environment's). A non-zero exit, or an `"error"` in what a command
  prints, fails the test;
- `flags`: commands that need what CI has not (a GPU, a key file, nginx, a corpus): every
  `--flag` of each `cachesmith ...` line must be one its `--help` lists;
- `vllm`: the vLLM launch, compared with the tested one by `tests/bench/test_vllm_launch.py`;
- `setup`: the make targets this test runs under; `config`: file contents, not commands.
A block without a kind fails the test, so a new example cannot escape.
"""
from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import free_port
from tests.server.test_serve_process import wait_up

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/serving.md", "docs/vllm.md")
KINDS = ("run", "flags", "vllm", "setup", "config")
BIN = Path(sys.executable).parent


def blocks(path: str) -> list[tuple[str, str, str]]:
    """(language, kind, body) of each fenced block of the file."""
    text = (REPO / path).read_text(encoding="utf-8")
    return [(lang, kind, body) for lang, kind, body in
            re.findall(r"^```(\w*)(?: example:(\w+))?[^\n]*\n(.*?)^```", text, re.S | re.M)]


@pytest.mark.parametrize("path", FILES)
def test_every_example_says_what_it_is(path):
    found = blocks(path)
    assert len(found) >= 5 and [kind for _, kind, _ in found if kind not in KINDS] == []


def cachesmith_lines(body: str) -> list[list[str]]:
    """Each `cachesmith ...` command of a block, split as the shell splits it (comments dropped)."""
    joined = body.replace("\\\n", " ")
    return [shlex.split(line, comments=True)[i:] for line in joined.splitlines()
            for i, word in enumerate(shlex.split(line, comments=True)[:3]) if word.endswith("cachesmith")]


def help_text(command: list[str]) -> str:
    out = subprocess.run([str(BIN / "cachesmith"), *command, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"cachesmith {' '.join(command)} --help: {out.stderr}"
    return out.stdout


@pytest.mark.parametrize("path", [f for f in FILES if any(kind == "flags" for _, kind, _ in blocks(f))])
def test_flags_of_examples_that_cannot_run_here_are_the_clis(path):
    commands = [argv for _, kind, body in blocks(path) if kind == "flags" for argv in cachesmith_lines(body)]
    assert commands
    for argv in commands:
        words = list(itertools.takewhile(lambda w: re.fullmatch(r"[a-z]+", w), argv[1:]))
        flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(argv))  # `[--flag X]` too
        known = help_text(words)
        assert [f for f in flags if f not in known] == [], " ".join(argv)


def run_block(lang: str, body: str, url: str, cwd: Path) -> str:
    body = body.replace("http://127.0.0.1:8000", url).replace(".venv/bin/", f"{BIN}/")
    cmd = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euo", "pipefail", "-c", body]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600)
    assert out.returncode == 0, f"{body}\n--- exit {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert '"error"' not in out.stdout, f"{body}\n--- printed an error:\n{out.stdout[-2000:]}"
    return out.stdout


def test_the_runnable_examples_run_against_a_live_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen([str(BIN / "cachesmith"), "serve", "--port", str(port), "--store-root",
                             str(tmp_path / "kv")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = wait_up(proc, port)
        outputs = [run_block(lang, body, url, tmp_path) for path in FILES
                   for lang, kind, body in blocks(path) if kind == "run"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    num_readme = sum(kind == "run" for _, kind, _ in blocks("README.md"))
    assert num_readme >= 6 and len(outputs) > num_readme
    assert all(out.strip() for out in outputs[:num_readme])  # each README example printed its answer
