"""`cachesmith serve` as a real process: SIGTERM drains in-flight streams, a restart on the same
disk store still has the chunks added before, two servers on one redis-server share chunks, and a
model nobody profiled serves after measuring its costs at start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from tests.redis_server import free_port
from tests.server.conftest import NAME, tiny_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer


def launch(model_dir, profile, store_root, port, tiers=("memory", "disk"), redis_url=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cachesmith.cli", "serve", "--model", str(model_dir), "--profile", str(profile),
           "--store-root", str(store_root), "--tiers", *tiers, "--port", str(port),
           "--served-name", NAME, "--max-tokens-limit", "1000", "--drain-timeout", "60"]
    cmd += ["--redis-url", redis_url] if redis_url else []
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_up(proc: subprocess.Popen, port: int) -> str:
    """The server's URL once /health answers."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not come up")


def start(model_dir, profile, store_root, port, **store) -> subprocess.Popen:
    proc = launch(model_dir, profile, store_root, port, **store)
    wait_up(proc, port)
    return proc


@pytest.fixture()
def setup(tiny_chat_dir, tmp_path):
    pipe = RagPipeline(str(tiny_chat_dir), store=ChunkStore(StoreConfig(tiers=("memory",))))
    profile = tmp_path / "profile.json"
    tiny_profile(pipe).save(profile)
    return tiny_chat_dir, profile, tmp_path / "kv"


def stream_to_end(url, body, first_event: threading.Event, out: list):
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                first_event.set()
    out.append((r.status_code, events, time.monotonic()))


def test_sigterm_drains_in_flight_streams_and_chunks_survive_a_restart(setup):
    model_dir, profile, store_root = setup
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_dir, profile, store_root, port)
    try:
        cid = httpx.post(url + "/v1/chunks", json={"documents": ["river glacier lantern harbor"]},
                         timeout=60).json()["data"][0]["id"]
        body = {"model": NAME, "prompt": "Which word?", "documents": [{"id": cid}, "copper amber silent"],
                "max_tokens": 400, "stream": True}
        outs: list = []
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=stream_to_end, args=(url, body, ev, outs)) for ev in started]
        for t in threads:
            t.start()
        assert all(ev.wait(60) for ev in started)  # every stream is under way
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(120)
        # uvicorn re-raises the signal once it has shut down gracefully: the conventional exit status
        assert proc.wait(120) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "Finished server process" in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(outs) == 4 and max(end for *_, end in outs) > signalled  # some were still streaming
    for status, events, _ in outs:
        assert status == 200 and events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] in ("stop", "length") and "cachesmith" in final

    proc = start(model_dir, profile, store_root, port)  # same disk store
    try:
        listed = httpx.get(url + "/v1/chunks", timeout=60).json()["data"]
        assert cid in {c["id"] for c in listed} and next(c for c in listed if c["id"] == cid)["tiers"] == ["disk"]
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) in (0, -signal.SIGINT)
    assert os.path.isdir(store_root)


def redis_hits(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text)
    return sum(s.value for f in families if f.name == "cachesmith:store_hits" for s in f.samples
               if s.labels.get("tier") == "redis" and s.name == "cachesmith:store_hits_total")


@pytest.mark.parametrize("shared", ["redis_url", "redis_cluster_url"])
def test_two_servers_on_one_redis_share_chunks(setup, shared, request):
    """Through one redis server, or a Redis Cluster named by one of its nodes."""
    redis_url = request.getfixturevalue(shared)
    model_dir, profile, store_root = setup
    ports = [free_port(), free_port()]
    procs = [launch(model_dir, profile, store_root, p, tiers=("memory", "redis"), redis_url=redis_url)
             for p in ports]  # started together: they load side by side
    try:
        a, b = (wait_up(proc, port) for proc, port in zip(procs, ports))
        text = "orchard beacon summit granite velvet canyon"
        cid = httpx.post(a + "/v1/chunks", json={"documents": [text]}, timeout=60).json()["data"][0]["id"]
        assert cid in {c["id"] for c in httpx.get(b + "/v1/chunks", timeout=60).json()["data"]}
        shown = httpx.get(f"{b}/v1/chunks/{cid}", timeout=60).json()
        assert shown["tiers"] == ["redis"] and shown["text"].startswith(text)  # B never computed it
        assert redis_hits(b) == 0
        r = httpx.post(b + "/v1/completions", json={"model": NAME, "prompt": "Which word?",
                                                    "documents": [{"id": cid}], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert redis_hits(b) > 0
        assert httpx.get(f"{b}/v1/chunks/{cid}", timeout=60).json()["tiers"] == ["memory", "redis"]  # filled
        assert httpx.delete(f"{a}/v1/chunks/{cid}", timeout=60).status_code == 200  # deleted through A ...
        deadline = time.monotonic() + 10
        while httpx.get(f"{b}/v1/chunks/{cid}", timeout=60).status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{b}/v1/chunks/{cid}", timeout=60).status_code == 404  # ... is gone from B's memory too
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    start = procs[0].stdout.read()
    wanted = "redis: cluster of 3 primaries and 3 replicas" if shared == "redis_cluster_url" else f"redis: {redis_url}"
    assert wanted in start, start[-2000:]


def test_a_model_nobody_profiled_serves_after_a_quick_cost_grid(tiny_chat_dir, tmp_path):
    """No `--profile` and an empty home: the server measures the quick cost grid, borrows the packaged
    demand mapped onto the model's 4 layers, warns once, saves the profile and serves RAG requests."""
    port, home = free_port(), tmp_path / "home"
    cmd = [sys.executable, "-m", "cachesmith.cli", "serve", "--model", str(tiny_chat_dir), "--port", str(port),
           "--store-root", str(tmp_path / "kv"), "--served-name", NAME, "--shed-late", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CACHESMITH_HOME": str(home)})
    try:
        url = wait_up(proc, port)
        docs = [" ".join(["river glacier lantern harbor meadow falcon"] * 20) + f" {d}." for d in range(3)]
        body = {"model": NAME, "max_tokens": 4, "documents": docs,
                "messages": [{"role": "user", "content": "Which word comes after river?"}]}
        first = httpx.post(url + "/v1/chat/completions", json={**body, "slo_ms": 5000}, timeout=120)
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] >= 1
        # an SLO no plan meets, with shedding off: served by full reuse, every context row read from the
        # stored chunks
        second = httpx.post(url + "/v1/chat/completions", json={**body, "slo_ms": 1}, timeout=120).json()
        assert second["cachesmith"]["cached_tokens"]["chunks"] == second["cachesmith"]["num_context_tokens"] > 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["cachesmith"]["num_context_tokens"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "mapped onto this model's 4 layers" in warnings[0], out
    saved = json.loads((home / "profiles" / f"{tiny_chat_dir.name}-float32-cpu.json").read_text())
    assert saved["num_layers"] == 4 and max(c["rank_depth"] for c in saved["demand"]) == 4
