"""A server whose redis tier goes away keeps answering from its local tiers, and says so in /metrics;
a delete it cannot carry to redis is refused with a 503, the entry kept."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import NAME

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer


def completion(documents: list) -> dict:
    return {"model": NAME, "prompt": "Which word comes after river?", "documents": documents, "max_tokens": 4}


def tiers_up(c: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(c.get("/metrics").text)
    return {s.labels["tier"]: s.value for f in families if f.name == "cachesmith:store_tier_up" for s in f.samples}


def test_a_server_whose_redis_goes_away_serves_from_memory(server_for, redis_server):
    srv = server_for(tiers=("memory", "redis"), redis_url=redis_server.url)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        before = c.post("/v1/completions", json=completion(["river glacier lantern harbor"]))
        assert before.status_code == 200 and tiers_up(c) == {"memory": 1.0, "redis": 1.0}
        redis_server.stop()
        again = c.post("/v1/completions", json=completion(["river glacier lantern harbor"]))
        fresh = c.post("/v1/completions", json=completion(["copper amber silent frozen"]))
        assert (again.status_code, fresh.status_code) == (200, 200), fresh.text
        assert again.json()["choices"] == before.json()["choices"]  # the same KV, from memory
        listed = c.get("/v1/chunks").json()["data"]
        assert listed and all(x["tiers"] == ["memory"] for x in listed)
        gone = c.delete(f"/v1/chunks/{listed[0]['id']}")  # redis would keep it: refused, worth a retry
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "store_unavailable"
        assert "redis" in gone.json()["error"]["message"] and gone.headers["retry-after"] == "5"
        assert c.get(f"/v1/chunks/{listed[0]['id']}").status_code == 200  # still stored
        text = c.get("/metrics").text
    assert f'cachesmith:store_tier_up{{model_name="{NAME}",tier="redis"}} 0.0' in text
    assert f'cachesmith:store_tier_up{{model_name="{NAME}",tier="memory"}} 1.0' in text
