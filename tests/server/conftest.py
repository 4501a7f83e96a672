"""Servers for the HTTP tests: the tiny random-weight chat model (fast) behind a real uvicorn on a
free loopback port, with a synthetic profile matched to it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.run import BackgroundServer
from tests.engine_helpers import save_tiny_chat_model
from tests.planner.synthetic_profile import make_profile

NAME = "tiny"


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-server"))


def tiny_profile(pipe: RagPipeline):
    """The synthetic profile, stamped with this model's identity (so it also loads from a file)."""
    return replace(make_profile(num_layers=pipe.model.num_layers), model_fingerprint=pipe.model.fingerprint)


def make_service(model_dir, store_root=None, tiers=("memory",), redis_url=None, kv_codec="none",
                 **overrides) -> Service:
    config = ServiceConfig(model=str(model_dir), served_name=NAME, **overrides)
    store = ChunkStore(StoreConfig(tiers=tiers, root=store_root, redis_url=redis_url, codec=kv_codec))
    pipe = RagPipeline(str(model_dir), store=store)
    return Service(config, pipe, tiny_profile(pipe))


@pytest.fixture()
def server_for(tiny_chat_dir):
    """`server_for(**service_overrides, server=ServerConfig(...))` -> a started BackgroundServer."""
    started = []

    def start(server: ServerConfig | None = None, **overrides) -> BackgroundServer:
        srv = BackgroundServer(make_service(tiny_chat_dir, **overrides),
                               server or ServerConfig(port=0, log_level="warning")).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
