"""Two servers on a Redis Cluster while a primary is killed under traffic: no request gets a 5xx
(each is answered from the server's local tiers or by prefill), every acknowledged upload is read
again from the cluster by a server that never saw it, and the killed primary's slots are served
again, by its promoted replica, within the node timeout and 5 s."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from benchmarks.common.redis_cluster import NODE_TIMEOUT_MS, start_cluster
from cachesmith.kvstore.redis_tier import RedisTier
from cachesmith.server.run import BackgroundServer
from tests.server.conftest import NAME
from tests.server.test_tenant_caps import redis_service, text

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

NUM_UPLOADS = 12


@pytest.fixture()
def cluster(tmp_path):
    started = start_cluster(tmp_path / "cluster")  # its own: a node of it dies
    yield started
    started.stop()


def serve(model_dir, url: str) -> BackgroundServer:
    return BackgroundServer(redis_service(model_dir, url, None)).start()


def traffic(url: str, ids: list[str], stop: threading.Event, statuses: list[int]) -> None:
    """Completions naming the uploads by id and sending new text, until `stop`."""
    i = 0
    while not stop.is_set():
        docs = [{"id": ids[i % len(ids)]}, text(1000 + i)]
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Which word?", "documents": docs,
                                                      "max_tokens": 2}, timeout=60)
        statuses.append(r.status_code)
        i += 1


def test_a_primary_killed_under_traffic_costs_no_5xx_and_no_acknowledged_upload(tiny_chat_dir, cluster):
    a, b = serve(tiny_chat_dir, cluster.url), serve(tiny_chat_dir, cluster.url)
    try:
        uploaded = httpx.post(a.url + "/v1/chunks", json={"documents": [text(i) for i in range(NUM_UPLOADS)]},
                              timeout=60)
        assert uploaded.status_code == 200, uploaded.text
        ids = [c["id"] for c in uploaded.json()["data"]]
        for cid in ids:  # B reads each once: its memory tier holds them through the failover
            assert httpx.get(f"{b.url}/v1/chunks/{cid}", timeout=60).status_code == 200
        tier = RedisTier(cluster.url)
        victim = tier.client.get_node_from_key(RedisTier.PREFIX + ids[0]).port
        on_victim = [c for c in ids if tier.client.get_node_from_key(RedisTier.PREFIX + c).port == victim]
        stop, statuses = threading.Event(), []
        runner = threading.Thread(target=traffic, args=(b.url, ids, stop, statuses))
        runner.start()
        time.sleep(1.0)
        cluster.kill(victim)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < NODE_TIMEOUT_MS / 1e3 + 5 and any(tier.source(c) is None for c in on_victim):
            time.sleep(0.1)
        back_s = time.monotonic() - killed_at
        time.sleep(1.0)  # traffic on the promoted replica too
        stop.set()
        runner.join(60)
        assert all(tier.source(c) is not None for c in on_victim), f"the slots were not served again in {back_s:.1f} s"
        assert len(statuses) >= 10 and all(s == 200 for s in statuses), (len(statuses), sorted(set(statuses)))
    finally:
        a.stop(), b.stop()
        a.service.close(10), b.service.close(10)
    c = serve(tiny_chat_dir, cluster.url)  # a server that never saw the uploads
    try:
        shown = [httpx.get(f"{c.url}/v1/chunks/{cid}", timeout=60) for cid in ids]
        assert [r.status_code for r in shown] == [200] * NUM_UPLOADS
        assert all(r.json()["tiers"] == ["redis"] for r in shown)
    finally:
        c.stop()
        c.service.close(10)
