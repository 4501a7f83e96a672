"""The vLLM connector's bookkeeping without vLLM, on fake requests (the attributes vLLM's scheduler
requests carry) and fake builds: the scheduler side (`connector_book`: claims, loads into the
blocks vLLM allocates, rebuilds of resumed requests, cache salts, reports) and the worker side
(`connector_builds`: synchronous and asynchronous builds, failures, the plan a rebuild reuses)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cachesmith.errors import ConfigError
from cachesmith.integrations.connector_book import Load, LoadBook, StoreSettings
from cachesmith.integrations.connector_builds import Built, Builds
from cachesmith.integrations.prompt_kv import ConnectorParams
from cachesmith.kvstore.keys import namespace_of

PROMPT = list(range(100, 110))  # 2 prefix tokens, chunks of 3 and 3, a question of 2
RAW = {"num_prefix_tokens": 2, "chunk_token_counts": [3, 3], "method": "full_reuse"}


@dataclass
class FakeRequest:
    """The attributes of vLLM's scheduler-side `Request` the connector reads."""
    request_id: str = "r1"
    prompt_token_ids: list[int] = field(default_factory=lambda: list(PROMPT))
    kv_transfer_params: dict | None = field(default_factory=lambda: {"cachesmith": dict(RAW)})
    arrival_time: float = 0.0
    cache_salt: str | None = None
    num_preemptions: int = 0


def admit(book: LoadBook, request: FakeRequest, block_ids: list[int]) -> list[Load]:
    """What vLLM's scheduler does on admitting (or resuming) a request: ask, allocate, build metadata."""
    num_tokens, _ = book.claim(request, 0)
    book.allocated(request, block_ids, num_tokens)
    return book.take_loads()


def report(request_id: str, **fields) -> dict:
    return {request_id: {"cachesmith": {"num_chunks": 2, **fields}}}


def test_every_prompt_token_but_the_last_is_claimed_and_loaded_into_the_allocated_blocks():
    book = LoadBook(load_async=False)
    request = FakeRequest()
    assert book.claim(request, 0) == (9, False)
    assert book.claim(request, 0) == (9, False)  # vLLM may ask again: nothing changes
    book.allocated(request, [4, 5], 9)
    (load,) = book.take_loads()
    assert (load.request_id, load.token_ids, load.block_ids, load.num_rows) == ("r1", PROMPT, [4, 5], 9)
    assert load.params == ConnectorParams.parse(RAW, len(PROMPT)) and load.num_rebuilds == 0
    assert book.take_loads() == []  # each load goes out once
    assert torch.equal(load.slots(8), torch.tensor([32, 33, 34, 35, 36, 37, 38, 39, 40]))


def test_a_request_without_parameters_or_allocated_nothing_gets_no_load():
    book = LoadBook(load_async=False)
    assert book.claim(FakeRequest(kv_transfer_params=None), 0) == (0, False)
    request = FakeRequest()
    book.claim(request, 0)
    book.allocated(request, [1, 2], 0)  # vLLM took no tokens from the connector
    assert book.take_loads() == []


def test_a_resumed_request_is_rebuilt_into_its_new_blocks():
    book = LoadBook(load_async=False)
    request = FakeRequest()
    (first,) = admit(book, request, [4, 5])
    book.reported(report("r1", num_chunks_stored=0))
    request.num_preemptions = 1  # vLLM preempted it (freeing blocks 4 and 5) and now resumes it
    (rebuild,) = admit(book, request, [7, 2])
    assert rebuild.block_ids == [7, 2] and rebuild.num_rebuilds == 1 and rebuild.token_ids == first.token_ids
    assert torch.equal(rebuild.slots(8), torch.tensor([56, 57, 58, 59, 60, 61, 62, 63, 16]))


def test_asynchronous_loads_are_claimed_as_such_and_loaded_once():
    book = LoadBook(load_async=True)
    request = FakeRequest()
    assert book.claim(request, 0) == (9, True)
    book.allocated(request, [3, 4], 9)
    assert len(book.take_loads()) == 1
    book.allocated(request, [3, 4], 0)  # vLLM allocates again once the load is received: no second load
    assert book.take_loads() == []


def test_a_request_whose_build_failed_is_never_claimed_again():
    book = LoadBook(load_async=False)
    request = FakeRequest()
    admit(book, request, [4, 5])
    book.reported({"r1": {"cachesmith": {"error": "CorruptEntry: not in the store", "fallback": "vllm_prefill"}}})
    request.num_preemptions = 1
    assert book.claim(request, 0) == (0, False)  # resumed: vLLM's own prefill again, not a mix
    assert book.finished("r1")["cachesmith"]["fallback"] == "vllm_prefill"


def test_refused_parameters_are_reported_by_field():
    book = LoadBook(load_async=False)
    request = FakeRequest(kv_transfer_params={"cachesmith": {**RAW, "slo_ms": -5}})
    assert book.claim(request, 0) == (0, False)
    assert "slo_ms=-5" in book.finished("r1")["cachesmith"]["error"]


def test_each_cache_salt_is_a_namespace_of_its_own():
    book = LoadBook(load_async=False)
    namespaces = {}
    for i, salt in enumerate(("alice", "bob", None, "alice")):
        (load,) = admit(book, FakeRequest(f"r{i}", cache_salt=salt), [i])
        namespaces[i] = load.namespace
    assert namespaces[0] == namespaces[3] == namespace_of("", "alice") != namespaces[1] == namespace_of("", "bob")
    assert namespaces[2] == "" and len(namespaces[0]) == 32


def test_a_cache_salt_the_store_cannot_take_is_refused_by_name():
    book = LoadBook(load_async=False)
    assert book.claim(FakeRequest(cache_salt="x" * 300), 0) == (0, False)
    assert "cache_salt" in book.finished("r1")["cachesmith"]["error"]


def test_a_request_that_finishes_before_its_report_gets_it_in_place():
    book = LoadBook(load_async=False)
    admit(book, FakeRequest(), [4, 5])
    params = book.finished("r1")  # it ended in its first step
    assert params == {}
    book.reported(report("r1", num_chunks_stored=2))
    assert params == {"cachesmith": {"num_chunks": 2, "num_chunks_stored": 2}}
    assert book.finished("r1") is None  # nothing left behind


def test_blocks_that_cannot_hold_the_rows_are_a_clear_error():
    load = Load("r1", PROMPT, ConnectorParams.parse(RAW, len(PROMPT)), "", 0.0, [3], 9)
    with pytest.raises(ValueError, match="1 blocks of 8 cannot hold the 9 prompt rows"):
        load.slots(8)


def test_store_settings_come_from_the_extra_config():
    assert StoreSettings.from_extra(lambda key, default: default) == StoreSettings(("memory", "disk"), None, None)
    extra = {"store_tiers": ["redis"], "store_root": "/tmp/kv", "redis_url": "redis://h:1/0", "kv_codec": "int8"}
    settings = StoreSettings.from_extra(lambda key, default: extra.get(key, default))
    config = settings.config()
    assert (config.tiers, config.root, config.redis_url, config.codec) == (("redis",), Path("/tmp/kv"),
                                                                          "redis://h:1/0", "int8")
    with pytest.raises(ConfigError, match="codec='fp8'"):
        StoreSettings.from_extra(lambda key, default: {"kv_codec": "fp8"}.get(key, default)).config()
    with pytest.raises(AttributeError):
        settings.tiers = ("memory",)  # frozen


# ---- worker side
def a_load(request_id="r1", block_ids=(4, 5), num_rebuilds=0) -> Load:
    return Load(request_id, PROMPT, ConnectorParams.parse(RAW, len(PROMPT)), "", 0.0, list(block_ids), 9,
                num_rebuilds)


class FakeBuild:
    """Records each call's (request id, plan given); returns plan `plan-<request id>-<n>`."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.calls, self.fail, self.gate = [], fail, gate

    def __call__(self, load: Load, plan) -> Built:
        if self.gate is not None:
            assert self.gate.wait(30)
        self.calls.append((load.request_id, plan, torch.is_inference_mode_enabled()))
        if self.fail:
            raise RuntimeError("no memory")
        return Built({"cachesmith": {"plan": "p"}}, {"prompts_built": 1}, f"plan-{load.request_id}-{len(self.calls)}")


def drain_until_received(builds: Builds, request_id: str):
    for _ in range(3000):
        results = builds.drain()
        if request_id in results.received:
            return results
        threading.Event().wait(0.01)
    raise AssertionError(f"{request_id} was never received")


def test_synchronous_builds_end_inside_start():
    build = FakeBuild()
    builds = Builds(build, load_async=False)
    builds.start([a_load()])
    assert build.calls == [("r1", None, True)]  # built before start returned, in inference mode
    results = builds.drain()
    assert results.reports == {"r1": {"cachesmith": {"plan": "p"}}} and results.counts == [{"prompts_built": 1}]
    assert results.received == set() and results.failed_blocks == set()  # nothing asynchronous to report
    assert builds.drain().reports == {}


def test_a_failed_build_reports_its_blocks_and_falls_back():
    builds = Builds(FakeBuild(fail=True), load_async=False)
    builds.start([a_load(block_ids=(4, 5))])
    results = builds.drain()
    assert results.failed_blocks == {4, 5} and results.counts == [{"prompts_fallback": 1}]
    assert results.reports["r1"]["cachesmith"] == {"error": "RuntimeError: no memory", "fallback": "vllm_prefill"}


def test_asynchronous_builds_run_off_the_step_and_are_reported_received():
    gate = threading.Event()
    build = FakeBuild(gate=gate)
    builds = Builds(build, load_async=True)
    try:
        builds.start([a_load()])  # returns while the build waits
        assert builds.drain().received == set() and build.calls == []
        gate.set()
        results = drain_until_received(builds, "r1")
        assert results.reports == {"r1": {"cachesmith": {"plan": "p"}}}
        assert build.calls == [("r1", None, True)]  # on the builder thread, also in inference mode
    finally:
        builds.shutdown()


def test_a_failed_asynchronous_build_is_received_with_its_failed_blocks():
    builds = Builds(FakeBuild(fail=True), load_async=True)
    try:
        builds.start([a_load(block_ids=(9,))])
        results = drain_until_received(builds, "r1")  # vLLM must release it from its wait
        assert results.failed_blocks == {9} and "fallback" in results.reports["r1"]["cachesmith"]
    finally:
        builds.shutdown()


@pytest.mark.parametrize("load_async", [False, True])
def test_a_rebuild_runs_the_first_builds_plan_until_the_request_finishes(load_async):
    build = FakeBuild()
    builds = Builds(build, load_async)
    try:
        builds.start([a_load()])
        drain_until_received(builds, "r1") if load_async else builds.drain()
        builds.start([a_load(block_ids=(7,), num_rebuilds=1)])
        drain_until_received(builds, "r1") if load_async else builds.drain()
        assert build.calls[1] == ("r1", "plan-r1-1", True)
        builds.drain(finished_req_ids={"r1"})  # vLLM says it finished: the plan is forgotten
        builds.start([a_load(num_rebuilds=1)])
        drain_until_received(builds, "r1") if load_async else builds.drain()
        assert build.calls[2][1] is None
    finally:
        builds.shutdown()


def test_a_request_finished_while_its_build_runs_leaves_no_plan_behind():
    gate = threading.Event()
    build = FakeBuild(gate=gate)
    builds = Builds(build, load_async=True)
    try:
        builds.start([a_load()])
        builds.drain(finished_req_ids={"r1"})  # aborted mid-build
        gate.set()
        assert "r1" in drain_until_received(builds, "r1").received  # still received: vLLM frees its blocks then
        builds.start([a_load(num_rebuilds=1)])
        drain_until_received(builds, "r1")
        assert build.calls[1][1] is None
    finally:
        builds.shutdown()
