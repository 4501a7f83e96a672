"""`POST /v1/feedback`: a client's verdict on a completion teaches a server that learns the served mix
(`cachesmith+task+learn`), is accepted and counted but not learned from by one that does not, and a
bad or unknown id is a 400 / 404 naming the field."""
from __future__ import annotations

import time
from dataclasses import replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachesmith.engine import EngineConfig
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.run import BackgroundServer
from tests.planner.test_served_mix import two_task_demand
from tests.server.conftest import NAME, tiny_profile

BODY = {"model": NAME, "prompt": "Which word comes after river?", "max_tokens": 2,
        "documents": ["river glacier lantern harbor meadow falcon"]}


def learning_server(model_dir, method: str) -> BackgroundServer:
    config = ServiceConfig(model=str(model_dir), served_name=NAME, engine=EngineConfig(method, "live"))
    pipe = RagPipeline(str(model_dir), store=ChunkStore(StoreConfig(tiers=("memory",))))
    profile = replace(tiny_profile(pipe), demand=two_task_demand())  # two tasks: a mix to learn
    return BackgroundServer(Service(config, pipe, profile), ServerConfig(port=0, log_level="warning")).start()


def feedback_counts(c: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(c.get("/metrics").text)
    return {s.labels["verdict"]: s.value for f in families if f.name == "cachesmith:feedback" for s in f.samples
            if s.name == "cachesmith:feedback_total"}


def test_a_verdict_teaches_a_learning_server_once(tiny_chat_dir):
    srv = learning_server(tiny_chat_dir, "cachesmith+task+learn")
    mix = srv.server.config.app.state.service.engine.planner.served_mix
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            first = c.post("/v1/completions", json=BODY).json()
            r = c.post("/v1/feedback", json={"id": first["id"], "passed": False})
            assert r.status_code == 200 and r.json() == {"id": first["id"], "object": "feedback", "passed": False,
                                                         "learned": True}
            again = c.post("/v1/feedback", json={"id": first["id"], "passed": True}).json()
            assert again["learned"] is False  # the first verdict on a request stands
            assert c.post("/v1/completions", json=BODY).status_code == 200  # a batch boundary: it is heard
            deadline = time.monotonic() + 10
            while mix.num_observed < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert mix.num_observed == 1
            assert feedback_counts(c) == {"passed": 1.0, "failed": 1.0}
            text = c.get("/metrics").text
            assert "cachesmith:served_mix_weight" in text
            # shadow calibration is metered: requests offered at 2%, the learned curves' move from the profile
            assert "cachesmith:shadow_sampled_total" in text and "cachesmith:shadow_samples_total" in text
            assert "cachesmith:learned_demand_shift" in text
    finally:
        srv.stop()


def test_a_server_that_does_not_learn_takes_the_verdict_without_learning(server_for):
    srv = server_for()  # the default method, cachesmith+task
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        done = c.post("/v1/completions", json=BODY).json()
        r = c.post("/v1/feedback", json={"id": done["id"], "passed": True})
        assert r.status_code == 200 and r.json()["learned"] is False
        assert feedback_counts(c) == {"passed": 1.0, "failed": 0.0}
        assert "cachesmith:served_mix_weight" not in c.get("/metrics").text
        assert "cachesmith:shadow_samples_total" not in c.get("/metrics").text


def test_unknown_ids_and_bad_bodies_name_their_field(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/feedback", json={"id": "cmpl-never", "passed": True})
        assert r.status_code == 404 and r.json()["error"]["param"] == "id"
        for body, param in (({"passed": True}, "id"), ({"id": "x"}, "passed"), ({"id": "", "passed": True}, "id"),
                            ({"id": "x", "passed": "maybe"}, "passed"), ({"id": "x", "passed": True, "n": 1}, "n")):
            r = c.post("/v1/feedback", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert feedback_counts(c) == {"passed": 0.0, "failed": 0.0}
