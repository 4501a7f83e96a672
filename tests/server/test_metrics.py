"""`/metrics` as vLLM names its series: one `cachesmith:` prefix, a `model_name` label on every sample,
vLLM's latency histograms (TTFT, end to end, per output token, between tokens), token counters and
prompt tokens by where their KV came from, the running / waiting gauges read from the live loop, no
`_created` series; and the Grafana dashboard queries only series the exposition has."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachesmith.engine import EngineConfig
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.server import Service, ServiceConfig
from cachesmith.server.metrics import (
    PROMPT_SOURCES,
    ServiceMetrics,
    prompt_token_sources,
    token_gaps_s,
)
from cachesmith.server.specs import CompletionSpec, DocumentRef
from tests.planner.test_served_mix import two_task_demand
from tests.server.conftest import NAME, make_service, tiny_profile

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

DOCS = ("river glacier lantern harbor meadow falcon", "copper amber silent frozen canyon velvet")
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
# as `# TYPE` lines name them (a counter with its `_total`)
NEW_SERIES = ("num_requests_running", "num_requests_waiting", "e2e_request_latency_seconds",
              "time_per_output_token_seconds", "inter_token_latency_seconds", "prompt_tokens_total",
              "generation_tokens_total", "prompt_tokens_by_source_total", "time_to_first_token_seconds",
              "prefix_cache_queries_total", "prefix_cache_hits_total")


def spec(question: str, max_tokens: int = 4) -> CompletionSpec:
    return CompletionSpec(tuple(DocumentRef(text=d) for d in DOCS), question, max_tokens=max_tokens, slo_s=60.0)


def learning_service(model_dir) -> Service:
    """A service that learns the served mix: it also exposes the served-mix and shadow series."""
    config = ServiceConfig(model=str(model_dir), served_name=NAME, engine=EngineConfig("cachesmith+task+learn", "live"))
    pipe = RagPipeline(str(model_dir), store=ChunkStore(StoreConfig(tiers=("memory",))))
    return Service(config, pipe, replace(tiny_profile(pipe), demand=two_task_demand()))


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def served(tiny_chat_dir):
    """A live service after three requests on the same documents (the later ones read the stored
    chunks and prefix): (its results, the exposition text). It reuses every stored context row
    (`full_reuse`): on these short documents the planner would recompute them all, and no prompt
    token would come from a stored chunk."""
    service = make_service(tiny_chat_dir, engine=EngineConfig("full_reuse", "live"))
    metrics = ServiceMetrics(service)
    try:
        results = [service.submit(spec(f"Which word comes after river, {i}?")).result(timeout=60) for i in range(3)]
        assert all(r.error is None for r in results)
        yield results, metrics.exposition().decode()
    finally:
        service.close(timeout=30)


@pytest.mark.parametrize("is_learning", [False, True])
def test_every_series_has_the_one_prefix_and_the_model_name(tiny_chat_dir, is_learning):
    service = learning_service(tiny_chat_dir) if is_learning else make_service(tiny_chat_dir)
    try:
        text = ServiceMetrics(service).exposition().decode()
    finally:
        service.close(timeout=30)
    types = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    assert len(types) >= 25 and all(t.startswith("cachesmith:") for t in types), types
    assert ("cachesmith:shadow_samples_total" in types) is is_learning  # the learning series are covered too
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert samples and all(s.labels.get("model_name") == NAME for s in samples)
    assert all(s.name.startswith("cachesmith:") for s in samples)
    assert "_created" not in text  # prometheus_client's timestamps are off, as in vLLM


def test_vllm_series_are_exposed(served):
    _, text = served
    types = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    assert {f"cachesmith:{name}" for name in NEW_SERIES} <= types
    assert {s.labels["source"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "cachesmith:prompt_tokens_by_source_total"} == set(PROMPT_SOURCES)


def test_results_carry_their_token_times(served):
    results, _ = served
    for r in results:
        times = r.token_times_s
        assert len(times) == r.num_output_tokens >= 1
        assert r.first_token_s <= times[0] and list(times) == sorted(times) and r.last_token_s == times[-1]


def test_latency_histograms_observe_each_served_request(served):
    results, text = served
    assert value(text, "cachesmith:time_to_first_token_seconds_count") == 3
    assert value(text, "cachesmith:e2e_request_latency_seconds_count") == 3
    e2e = sum(r.last_token_s - r.arrival_s for r in results)
    assert value(text, "cachesmith:e2e_request_latency_seconds_sum") == pytest.approx(e2e)
    assert e2e >= sum(r.ttft_s for r in results)
    multi = [r for r in results if r.num_output_tokens >= 2]
    assert multi  # four tokens asked of a random-weight model: end of sequence first is all but impossible
    assert value(text, "cachesmith:time_per_output_token_seconds_count") == len(multi)
    tpot = sum((r.last_token_s - r.token_times_s[0]) / (r.num_output_tokens - 1) for r in multi)
    assert value(text, "cachesmith:time_per_output_token_seconds_sum") == pytest.approx(tpot)
    gaps = [g for r in results for g in token_gaps_s(r)]
    assert value(text, "cachesmith:inter_token_latency_seconds_count") == len(gaps) == sum(
        r.num_output_tokens - 1 for r in results)
    assert value(text, "cachesmith:inter_token_latency_seconds_sum") == pytest.approx(sum(gaps))
    assert value(text, "cachesmith:inter_token_latency_seconds_bucket", le="+Inf") == len(gaps)


def test_token_counters_and_prompt_sources_add_up(served):
    results, text = served
    for r in results:
        sources = prompt_token_sources(r)
        assert sum(sources.values()) == r.num_prompt_tokens and min(sources.values()) >= 0
        assert sources["stored_chunk"] + sources["conversation_prefix"] == r.num_cached_tokens
        assert sources["recomputed"] > 0  # the question is always computed
    prompt = sum(r.num_prompt_tokens for r in results)
    by_source = {s: value(text, "cachesmith:prompt_tokens_by_source_total", source=s) for s in PROMPT_SOURCES}
    assert value(text, "cachesmith:prompt_tokens_total") == sum(by_source.values()) == prompt
    assert value(text, "cachesmith:prefix_cache_queries_total") == prompt
    cached = by_source["stored_chunk"] + by_source["conversation_prefix"]
    assert value(text, "cachesmith:prefix_cache_hits_total") == cached
    # the first request stored the chunks and prefix (computed for it); the later two read them
    first = prompt_token_sources(results[0])
    assert first["stored_chunk"] == first["conversation_prefix"] == 0
    for r in results[1:]:
        assert prompt_token_sources(r)["stored_chunk"] == r.num_context_tokens > 0
        assert prompt_token_sources(r)["conversation_prefix"] > 0
    assert value(text, "cachesmith:generation_tokens_total") == sum(r.num_output_tokens for r in results) > 0


@pytest.mark.parametrize("is_decode_overlapped", [True, False])
def test_running_and_waiting_are_read_from_the_live_loop(tiny_chat_dir, is_decode_overlapped):
    service = make_service(tiny_chat_dir, is_decode_overlapped=is_decode_overlapped)
    metrics = ServiceMetrics(service)

    def gauges() -> dict[str, float]:
        text = metrics.exposition().decode()
        return {k: value(text, f"cachesmith:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                            "queue_depth")}

    gate, entered, original = threading.Event(), threading.Event(), service.engine.prefill_batch
    service.engine.prefill_batch = lambda d, b: (entered.set(), gate.wait(30), original(d, b))[2]
    try:
        first = service.submit(spec("first?"))
        assert entered.wait(10)  # the loop took the first request, and holds it in its prefill
        second = service.submit(spec("second?"))
        assert gauges() == {"num_requests_running": 1, "num_requests_waiting": 1, "queue_depth": 1}
        gate.set()
        assert first.result(timeout=60).error is None and second.result(timeout=60).error is None
        deadline = time.monotonic() + 10  # the loop counts a request done just after answering it
        while gauges()["num_requests_running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauges() == {"num_requests_running": 0, "num_requests_waiting": 0, "queue_depth": 0}
    finally:
        gate.set()
        service.close(timeout=30)


def dashboard_exprs(node) -> list[str]:
    """Every PromQL query in the dashboard: panel targets' `expr` and template variables' queries."""
    if isinstance(node, list):
        return [e for item in node for e in dashboard_exprs(item)]
    if not isinstance(node, dict):
        return []
    own = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
    return own + [e for v in node.values() for e in dashboard_exprs(v)]


def test_the_grafana_dashboard_queries_only_exposed_series(served):
    _, text = served
    dashboard = json.loads(DASHBOARD.read_text())
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    exprs = dashboard_exprs(dashboard)
    used = {m for e in exprs for m in re.findall(r"cachesmith:[a-z0-9_]+", e)}  # e2e has a digit
    assert used and used <= names, sorted(used - names)
    for wanted in ("time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "time_per_output_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                   "prompt_tokens_by_source_total", "qsa_total", "requests_served_total", "store_hits_total"):
        assert f"cachesmith:{wanted}" in used, wanted
    assert any("histogram_quantile(0.99" in e for e in exprs) and any("histogram_quantile(0.5" in e for e in exprs)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables
    targets = [t for p in dashboard["panels"] for t in p["targets"]]
    assert all('model_name=~"$model_name"' in t["expr"] for t in targets)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])


def test_store_evictions_are_counted_by_cause(tiny_chat_dir, tmp_path):
    service = make_service(tiny_chat_dir, store_root=tmp_path, tiers=("disk",))
    try:
        disk = service.store.tiers[0]
        [first] = service.add_chunks(["river glacier lantern harbor meadow falcon"])
        disk.quota.max_bytes = disk.path(first.chunk_id).stat().st_size * 3 // 2  # room for one entry
        [second] = service.add_chunks(["copper amber silent frozen canyon velvet"])
        path = disk.path(second.chunk_id)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        assert service.store.get(second.chunk_id, service.pipeline.model) is None  # corrupt: evicted
        families = {f.name: f for f in text_string_to_metric_families(ServiceMetrics(service).exposition().decode())}
    finally:
        service.close(timeout=30)
    [quota] = families["cachesmith:store_evicted_quota"].samples
    assert quota.labels["tier"] == "disk" and quota.value == 1  # the first entry made room for the second
    assert families["cachesmith:store_evicted_corrupt"].samples[0].value == 1


def test_stored_bytes_per_token_are_exposed_by_codec(tiny_chat_dir):
    """Entries a server writes under `--kv-codec int8` are counted at their encoded size, under
    that codec's label: about a quarter of float32's bytes, header included."""
    per_token = {}
    for name in ("none", "int8"):
        service = make_service(tiny_chat_dir, kv_codec=name)
        try:
            service.add_chunks(["river glacier lantern harbor meadow falcon " * 20])
            text = ServiceMetrics(service).exposition().decode()
        finally:
            service.close(timeout=30)
        [sample] = {f.name: f for f in text_string_to_metric_families(text)}["cachesmith:store_bytes_per_token"].samples
        per_token[sample.labels["codec"]] = sample.value
    assert set(per_token) == {"none", "int8"} and 0 < per_token["int8"] < 0.35 * per_token["none"]
