"""The GPU check's end-to-end leg: `cachesmith serve` as a child process, answering RAG requests
and a chat over loopback (stdlib client).

In: the check's arguments (--device, --dtype, --doc-words, --tokenizer-dir), the model folder that
`random_model.build_model` wrote, a scratch folder (the server's CACHESMITH_HOME, its store and
serve.log go there) and the run's clock (`check_rows.Clock`: how long to wait for the server and
for each answer). Where the check itself runs on the simulated CUDA device
(`cachesmith.testing.sim_run`), the server is started under it too, so that `--device cuda` serves.
Out: `serve_row`'s fields: the server's startup time, NUM_RAG (10) RAG requests (4-5 made-up
documents drawn from a pool of 8, so documents recur in new orders) and one plain chat, each
answer's status, client ms and `cachesmith` object; how many were answered with a plan, the plans
chosen and the context tokens read from stored chunks; `passed` when every RAG request was
planned. `skipped` instead when a package in SERVE_PACKAGES is missing or there are no tokenizer
files. The server is stopped whatever happened (SIGTERM to its process group, SIGKILL after 30 s).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common.check_rows import Clock
from benchmarks.common.ports import free_port

from cachesmith.testing import sim_cuda

REPO = Path(__file__).resolve().parents[2]
NUM_RAG = 10
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "xxhash")


def documents(num: int, words: int, seed: int) -> list[str]:
    """Made-up passages: nonsense words in sentences, each passage naming a code of its own."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "dor", "ni", "pa", "gor", "li", "ste", "qua", "bri"]

    def word() -> str:
        return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
    out = []
    for _ in range(num):
        sentences, n = [f"The code of {word().title()} is {rng.randrange(1000, 9999)}."], 0
        while n < words:
            k = rng.randint(6, 14)
            sentences.append(" ".join(word() for _ in range(k)).capitalize() + ".")
            n += k
        out.append(" ".join(sentences))
    return out


def post(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # a 4xx / 5xx: its status and body are the record
        return exc.code, json.loads(exc.read() or b"{}")


def server_python() -> list[str]:
    """The command that runs `cachesmith.cli`: under the simulation when this process is (a plain
    child would see no CUDA device), else directly."""
    if sim_cuda.active() is not None:
        return [sys.executable, "-m", "cachesmith.testing.sim_run", "cachesmith.cli"]
    return [sys.executable, "-m", "cachesmith.cli"]


def start_server(args, model_dir: Path, work: Path, deadline: float) -> tuple[subprocess.Popen, str, Path]:
    """`cachesmith serve` on a free loopback port, its home and store in `work`; waits for /health."""
    port, log = free_port(), work / "serve.log"
    cmd = [*server_python(), "serve", "--model", str(model_dir), "--device", args.device,
           "--dtype", args.dtype, "--port", str(port), "--served-name", "gpu-check", "--drain-timeout", "5",
           "--store-root", str(work / "kv")]
    env = {**os.environ, "CACHESMITH_HOME": str(work / "home"),  # its profile and kernels stay in the scratch
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, url, log
        except OSError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health in time: {log.read_text()[-1500:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ask(url: str, body: dict, timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        status, reply = post(url + "/v1/chat/completions", {"model": "gpu-check", "max_tokens": 16, **body}, timeout_s)
    except (OSError, ValueError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    record = {"status": status, "client_ms": 1e3 * (time.perf_counter() - start), "cachesmith": reply.get("cachesmith")}
    if status != 200:
        record["body"] = reply
    return record


def serve_row(args, model_dir: Path, work: Path, clock: Clock) -> dict:
    missing = [p for p in SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return {"skipped": f"not installed: {', '.join(missing)} (make gpu-kit, then make gpu-check installs them)"}
    if args.tokenizer_dir is None:
        return {"skipped": "no tokenizer files (--tokenizer-dir)"}
    start = time.monotonic()
    proc, url, _ = start_server(args, model_dir, work, time.monotonic() + max(clock.left(), 60.0))
    up = time.monotonic() - start
    try:
        rng, pool = random.Random(5), documents(8, args.doc_words, seed=5)
        rag = []
        for i in range(NUM_RAG):
            docs = rng.sample(pool, rng.randint(4, 5))
            rag.append(ask(url, {"documents": docs, "slo_ms": 2000, "messages": [
                {"role": "user", "content": f"What is the code in passage {rng.randint(1, len(docs))}?"}]},
                timeout_s=max(30.0, clock.left())))
        chat = ask(url, {"messages": [{"role": "user", "content": "Name a colour."}]},
                   timeout_s=max(30.0, clock.left()))
    finally:
        stop_server(proc)
    served = [r.get("cachesmith") or {} for r in rag if r["status"] == 200]
    with_plan = sum(1 for c in served if c.get("plan"))
    # the planner may well choose full prefill for a model this fast: how much the answers reused
    reused = sum((c.get("cached_tokens") or {}).get("chunks", 0) for c in served)
    return {"startup_s": up, "num_rag": NUM_RAG, "answered_with_plan": with_plan, "reused_chunk_tokens": reused,
            "plans": sorted({c.get("plan") for c in served if c.get("plan")}), "rag": rag, "chat": chat,
            "passed": with_plan == NUM_RAG}
