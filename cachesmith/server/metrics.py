"""Prometheus metrics of one service, in a registry of its own (several servers in one process,
as in tests, never share counters).

In: every finished `RequestResult` (a service listener), and at scrape time the engine's, loop's
and store's own counters (read by a collector, so nothing is counted twice or in the hot path).
Out: the text exposition format for `/metrics`.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cachesmith.request import RequestResult
from cachesmith.server.service import Service

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 30.0, 60.0)


class ServiceMetrics:
    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        # vLLM's name with our prefix, so dashboards built on vllm:time_to_first_token_seconds carry over
        self.ttft = Histogram("cachesmith:time_to_first_token_seconds",
                              "Time to first token (arrival to first token)", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        # vLLM's prefix-cache counters, in tokens: prompt tokens looked up, and those served from
        # stored KV without recompute (usage.prompt_tokens_details.cached_tokens)
        self.cache_queries = Counter("cachesmith:prefix_cache_queries", "Prompt tokens of served requests",
                                     registry=self.registry)
        self.cache_hits = Counter("cachesmith:prefix_cache_hits",
                                  "Prompt tokens served from stored KV and not recomputed", registry=self.registry)
        self.served = Counter("cachesmith_requests_served", "Requests that got an answer, by SLO and gate",
                              ["on_time", "gate"], registry=self.registry)
        self.qsa = Counter("cachesmith_qsa", "Requests on time and passing their quality gate (QSA numerator)",
                           registry=self.registry)
        self.failed = Counter("cachesmith_requests_failed", "Requests refused at admission, failed in a batch, or cancelled",
                              ["reason"], registry=self.registry)
        for on_time in ("true", "false"):
            for gate in ("passed", "failed", "none"):
                self.served.labels(on_time, gate)
        for reason in ("invalid", "internal", "cancelled"):
            self.failed.labels(reason)
        self.registry.register(_EngineCollector(service))
        service.listeners.append(self.observe)

    def observe(self, result: RequestResult) -> None:
        if result.error is not None:
            self.failed.labels(result.error_kind or "invalid").inc()
            return
        self.ttft.observe(result.ttft_s)
        self.cache_queries.inc(result.num_prompt_tokens)
        self.cache_hits.inc(result.num_cached_tokens)
        gate = "none" if result.is_passed is None else "passed" if result.is_passed else "failed"
        self.served.labels(str(result.is_on_time).lower(), gate).inc()
        if result.is_qsa:
            self.qsa.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the live state at scrape time."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        svc = self.service
        st, store = svc.engine.stats, svc.store.stats
        yield GaugeMetricFamily("cachesmith_queue_depth", "Requests waiting (admitted or being admitted)",
                                value=svc.queue_depth)
        yield CounterMetricFamily("cachesmith_batches", "Batches run", value=st.num_batches)
        yield CounterMetricFamily("cachesmith_busy_seconds", "Time spent prefilling batches", value=st.busy_s)
        yield CounterMetricFamily("cachesmith_stall_seconds", "Of the busy time, waiting on KV transfer",
                                  value=st.stall_s)
        yield CounterMetricFamily("cachesmith_monitor_replans", "Runtime-monitor coverage lowerings",
                                  value=st.num_monitor_replans)
        rejected = CounterMetricFamily("cachesmith_requests_rejected", "Requests turned away before queueing",
                                       labels=["reason"])
        for reason in ("queue_full", "closed", "invalid"):
            rejected.add_metric([reason], svc.num_rejected[reason])
        yield rejected
        feedback = CounterMetricFamily("cachesmith_feedback", "Verdicts clients sent on completions (POST "
                                       "/v1/feedback)", labels=["verdict"])
        for verdict in ("passed", "failed"):
            feedback.add_metric([verdict], svc.num_feedback[verdict])
        yield feedback
        mix = svc.engine.planner.served_mix
        if mix is not None:  # the served mix learned from verdicts: each profiled task's weight
            weights = GaugeMetricFamily("cachesmith_served_mix_weight", "The learned served mix's weight on "
                                        "each profiled task's demand", labels=["task"])
            for task, weight in mix.describe().items():
                weights.add_metric([task], weight)
            yield weights
        yield from _shadow_metrics(svc.engine)
        hits = CounterMetricFamily("cachesmith_store_hits", "Chunk store reads served, by tier", labels=["tier"])
        for tier in svc.store.tiers:
            hits.add_metric([tier.name], store.hits[tier.name])
        yield hits
        yield CounterMetricFamily("cachesmith_store_misses", "Chunk store reads no tier could serve",
                                  value=store.misses)
        yield GaugeMetricFamily("cachesmith_store_hit_rate", "Store hits / reads since start",
                                value=store.hit_rate())
        up = GaugeMetricFamily("cachesmith_store_tier_up", "1 if the store tier is reachable now, else 0 "
                               "(reads and writes then skip it)", labels=["tier"])
        for tier in svc.store.tiers:
            up.add_metric([tier.name], float(tier.is_up))
        yield up


def _shadow_metrics(engine):
    """Shadow calibration (`+learn` methods): the samples taken and how far the learned curves moved."""
    shadow, learned = engine.shadow, engine.planner.learned
    if shadow is None or learned is None:
        return
    st = shadow.stats
    yield CounterMetricFamily("cachesmith_shadow_sampled", "Served requests kept for shadow evaluation",
                              value=st.num_sampled)
    yield CounterMetricFamily("cachesmith_shadow_dropped", "Sampled requests dropped: too many waited",
                              value=st.num_dropped)
    yield CounterMetricFamily("cachesmith_shadow_samples", "Shadow samples measured to the end and learned from",
                              value=st.num_samples)
    yield CounterMetricFamily("cachesmith_shadow_seconds", "Idle time spent on shadow work", value=st.seconds)
    yield GaugeMetricFamily("cachesmith_shadow_max_unit_seconds", "The longest shadow unit: the most a request "
                            "arriving during one waited for it", value=st.max_unit_s)
    yield GaugeMetricFamily("cachesmith_learned_demand_shift", "Largest move of a learned demand curve from "
                            "the profile's (pass probability)", value=learned.shift())
