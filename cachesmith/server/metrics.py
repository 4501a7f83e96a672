"""Prometheus metrics of one service, named as vLLM names its own (`vllm:x` -> `cachesmith:x`), in a
registry of its own (several servers in one process, as in tests, never share counters).

In: every finished `RequestResult` (a service listener): its latencies (time to first token, end to
end, per output token, between tokens) and token counts; and at scrape time the engine's, loop's and
store's own counters and gauges (read by a collector, so nothing is counted twice or in the hot path).
Out: the text exposition format for `/metrics`: every series is named `cachesmith:<name>` and
labelled `model_name` (the served model name), so dashboards built for vLLM carry over and one
dashboard tells several models apart.
"""
from __future__ import annotations

from itertools import pairwise

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cachesmith.request import RequestResult
from cachesmith.server.service import Service

# prometheus_client adds a `<name>_created` timestamp series beside every counter and histogram; vLLM
# turns them off, and they would double the series a scrape carries for no use on a dashboard. The
# switch is process-global: this module is where the server's metrics are made, so it is thrown here.
disable_created_metrics()

PREFIX = "cachesmith:"
MODEL_LABEL = "model_name"
# vLLM's buckets, so its dashboards' quantiles read the same
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 30.0, 60.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0)
# where each prompt token's KV came from (after vLLM's prompt_tokens_by_source)
PROMPT_SOURCES = ("stored_chunk", "conversation_prefix", "recomputed")


def prompt_token_sources(result: RequestResult) -> dict[str, int]:
    """A served request's prompt tokens by where their KV came from: context rows read from stored
    chunk KV and not recomputed, the conversation prefix read from the store, and the rest (computed
    for this request). They add up to `num_prompt_tokens`."""
    stored, prefix = sum(result.reused_by_chunk), result.num_cached_prefix
    return {"stored_chunk": stored, "conversation_prefix": prefix,
            "recomputed": result.num_prompt_tokens - stored - prefix}


def token_gaps_s(result: RequestResult) -> list[float]:
    """The time between each two consecutive tokens of a request (none before its second token)."""
    return [later - earlier for earlier, later in pairwise(result.token_times_s)]


class ServiceMetrics:
    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        self.model_name = service.config.name
        self._make_latency_metrics()
        self._make_token_metrics()
        self._make_outcome_metrics()
        self.registry.register(_EngineCollector(service))
        service.listeners.append(self.observe)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets, registry=self.registry
                         ).labels(self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(PREFIX + name, doc, [MODEL_LABEL], registry=self.registry).labels(self.model_name)

    def _make_latency_metrics(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token (arrival to first "
                                    "token)", TTFT_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to the last token of a served "
                                   "request", E2E_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Per request with two or more tokens: "
                                    "first to last token over the tokens after the first", TOKEN_GAP_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two consecutive tokens of a "
                                   "request", TOKEN_GAP_BUCKETS)

    def _make_token_metrics(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens of served requests")
        self.generation_tokens = self._counter("generation_tokens_total", "Tokens generated for served "
                                               "requests")
        self.by_source = Counter(PREFIX + "prompt_tokens_by_source_total", "Prompt tokens of served requests "
                                 "by where their KV came from: stored_chunk (stored chunk KV, not recomputed), "
                                 "conversation_prefix (the stored prompt prefix), recomputed (computed for the "
                                 "request)", [MODEL_LABEL, "source"], registry=self.registry)
        for source in PROMPT_SOURCES:
            self.by_source.labels(self.model_name, source)
        # vLLM's prefix-cache counters, in tokens: prompt tokens looked up, and those served from
        # stored KV without recompute (usage.prompt_tokens_details.cached_tokens)
        self.cache_queries = self._counter("prefix_cache_queries", "Prompt tokens of served requests")
        self.cache_hits = self._counter("prefix_cache_hits", "Prompt tokens served from stored KV and not "
                                        "recomputed")

    def _make_outcome_metrics(self) -> None:
        self.served = Counter(PREFIX + "requests_served", "Requests that got an answer, by SLO and gate",
                              [MODEL_LABEL, "on_time", "gate"], registry=self.registry)
        self.qsa = self._counter("qsa", "Requests on time and passing their quality gate (QSA numerator)")
        self.failed = Counter(PREFIX + "requests_failed", "Requests refused at admission, failed in a batch, "
                              "or cancelled", [MODEL_LABEL, "reason"], registry=self.registry)
        for on_time in ("true", "false"):
            for gate in ("passed", "failed", "none"):
                self.served.labels(self.model_name, on_time, gate)
        for reason in ("invalid", "internal", "cancelled"):
            self.failed.labels(self.model_name, reason)

    def observe(self, result: RequestResult) -> None:
        if result.error is not None:
            self.failed.labels(self.model_name, result.error_kind or "invalid").inc()
            return
        self._observe_latencies(result)
        self._observe_tokens(result)
        gate = "none" if result.is_passed is None else "passed" if result.is_passed else "failed"
        self.served.labels(self.model_name, str(result.is_on_time).lower(), gate).inc()
        if result.is_qsa:
            self.qsa.inc()

    def _observe_latencies(self, result: RequestResult) -> None:
        self.ttft.observe(result.ttft_s)
        # an answer that ended at its first step (end of sequence) kept no token and finished there
        end = result.first_token_s if result.last_token_s is None else result.last_token_s
        self.e2e.observe(end - result.arrival_s)
        gaps = token_gaps_s(result)
        if gaps:  # vLLM's TPOT: the mean gap, over requests with two or more tokens
            self.tpot.observe((result.token_times_s[-1] - result.token_times_s[0]) / len(gaps))
        for gap in gaps:
            self.itl.observe(gap)

    def _observe_tokens(self, result: RequestResult) -> None:
        self.prompt_tokens.inc(result.num_prompt_tokens)
        self.generation_tokens.inc(result.num_output_tokens)
        for source, num_tokens in prompt_token_sources(result).items():
            self.by_source.labels(self.model_name, source).inc(num_tokens)
        self.cache_queries.inc(result.num_prompt_tokens)
        self.cache_hits.inc(result.num_cached_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _single(family_type, model: str, name: str, doc: str, value: float):
    """A family of one sample, labelled with the served model's name."""
    family = family_type(PREFIX + name, doc, labels=[MODEL_LABEL])
    family.add_metric([model], value)
    return family


def _by(family_type, model: str, name: str, doc: str, label: str, values: dict):
    """A family of one sample per value of `label`, each labelled with the served model's name too."""
    family = family_type(PREFIX + name, doc, labels=[MODEL_LABEL, label])
    for key, value in values.items():
        family.add_metric([model, key], value)
    return family


class _EngineCollector:
    """Reads the live state at scrape time."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        svc = self.service
        model = svc.config.name
        yield from _load_metrics(svc, model)
        yield from _engine_metrics(svc, model)
        mix = svc.engine.planner.served_mix
        if mix is not None:  # the served mix learned from verdicts: each profiled task's weight
            yield _by(GaugeMetricFamily, model, "served_mix_weight", "The learned served mix's weight on each "
                      "profiled task's demand", "task", mix.describe())
        yield from _shadow_metrics(svc.engine, model)
        yield from _store_metrics(svc, model)


def _load_metrics(svc: Service, model: str):
    """What is running and waiting now, and what was turned away or judged by clients."""
    yield _single(GaugeMetricFamily, model, "num_requests_running", "Requests whose prefill batch or "
                  "decoding is in progress", svc.loop.num_running)
    yield _single(GaugeMetricFamily, model, "num_requests_waiting", "Requests queued, not yet in a batch",
                  svc.engine.queue_depth)
    yield _single(GaugeMetricFamily, model, "queue_depth", "Requests waiting (queued or being admitted)",
                  svc.queue_depth)
    yield _by(CounterMetricFamily, model, "requests_rejected", "Requests turned away before queueing",
              "reason", {reason: svc.num_rejected[reason]
                         for reason in ("queue_full", "closed", "invalid", "slo_unattainable")})
    yield _by(CounterMetricFamily, model, "requests_shed", "Requests refused as unable to meet their SLO by the "
              "shedding margin (429 slo_unattainable): at arrival, or once queued", "when",
              {"arrival": svc.num_rejected["slo_unattainable"], "queued": svc.loop.num_shed_queued})
    yield _single(CounterMetricFamily, model, "turn_stores_dropped", "Chat turns answered without storing their "
                  "conversation for the next turn: the store queue was full", svc.num_turn_stores_dropped)
    yield _by(CounterMetricFamily, model, "feedback", "Verdicts clients sent on completions (POST "
              "/v1/feedback)", "verdict", {verdict: svc.num_feedback[verdict] for verdict in ("passed", "failed")})


def _engine_metrics(svc: Service, model: str):
    st = svc.engine.stats
    yield _single(CounterMetricFamily, model, "batches", "Batches run", st.num_batches)
    yield _single(CounterMetricFamily, model, "busy_seconds", "Time spent prefilling batches", st.busy_s)
    yield _single(CounterMetricFamily, model, "stall_seconds", "Of the busy time, waiting on KV transfer",
                  st.stall_s)
    yield _single(CounterMetricFamily, model, "monitor_replans", "Runtime-monitor coverage lowerings",
                  st.num_monitor_replans)


def _store_metrics(svc: Service, model: str):
    store, tiers = svc.store.stats, svc.store.tiers
    yield _by(CounterMetricFamily, model, "store_hits", "Chunk store reads served, by tier", "tier",
              {tier.name: store.hits[tier.name] for tier in tiers})
    yield _single(CounterMetricFamily, model, "store_misses", "Chunk store reads no tier could serve",
                  store.misses)
    yield _single(GaugeMetricFamily, model, "store_hit_rate", "Store hits / reads since start", store.hit_rate())
    yield _by(GaugeMetricFamily, model, "store_bytes_per_token", "Stored bytes per token of the entries written "
              "since start, by codec (none: as computed; int8, int4: encoded)", "codec", store.bytes_per_token())
    yield _single(CounterMetricFamily, model, "store_evicted_corrupt", "Stored entries found unusable on read "
                  "(checksum, truncation, another model's) and evicted, to be recomputed", store.evicted_corrupt)
    quotas = {tier.name: tier.quota.num_evicted for tier in tiers if getattr(tier, "quota", None) is not None}
    yield _by(CounterMetricFamily, model, "store_evicted_quota", "Entries evicted (least recently used) to keep "
              "a tier within its byte quota", "tier", quotas)
    yield _by(GaugeMetricFamily, model, "store_tier_up", "1 if the store tier is reachable now, else 0 (reads "
              "and writes then skip it)", "tier", {tier.name: float(tier.is_up) for tier in tiers})


def _shadow_metrics(engine, model: str):
    """Shadow calibration (`+learn` methods): the samples taken and how far the learned curves moved."""
    shadow, learned = engine.shadow, engine.planner.learned
    if shadow is None or learned is None:
        return
    st = shadow.stats
    yield _single(CounterMetricFamily, model, "shadow_sampled", "Served requests kept for shadow evaluation",
                  st.num_sampled)
    yield _single(CounterMetricFamily, model, "shadow_dropped", "Sampled requests dropped: too many waited",
                  st.num_dropped)
    yield _single(CounterMetricFamily, model, "shadow_skipped", "Sampled requests whose stored entries were "
                  "gone before they were measured", st.num_skipped)
    yield _single(CounterMetricFamily, model, "shadow_samples", "Shadow samples measured to the end and "
                  "learned from", st.num_samples)
    yield _single(CounterMetricFamily, model, "shadow_seconds", "Idle time spent on shadow work", st.seconds)
    yield _single(GaugeMetricFamily, model, "shadow_max_unit_seconds", "The longest shadow unit: the most a "
                  "request arriving during one waited for it", st.max_unit_s)
    yield _single(GaugeMetricFamily, model, "learned_demand_shift", "Largest move of a learned demand curve "
                  "from the profile's (pass probability)", learned.shift())
