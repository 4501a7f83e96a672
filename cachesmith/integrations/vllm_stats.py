"""The cachesmith connector's counters in vLLM's own stats path (its log line and its /metrics).

In: per-step counts from the connector's worker (prompts built, rebuilt after vLLM preempted and
resumed their request, or fallen back to vLLM's prefill; chunks served by the store or prefilled;
tokens). Out: `ConnectorStats`, which vLLM sums across workers and steps, and
`ConnectorPromMetrics`, which vLLM asks for at start-up and feeds with those sums:
`cachesmith:vllm_prompts_total{outcome}`, `cachesmith:vllm_chunks_total{source}` and
`cachesmith:vllm_tokens_total{kind}` beside vLLM's series, with vLLM's labels (model name, engine).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# counter name -> (its label, {label value: the stats key counting it}, help text)
SERIES = {
    "cachesmith:vllm_prompts": ("outcome", {"built": "prompts_built", "rebuilt": "prompts_rebuilt",
                                            "fallback": "prompts_fallback"},
                                "Prompt builds: first builds, rebuilds after vLLM preempted and resumed the "
                                "request, builds that failed and fell back to vLLM's prefill"),
    "cachesmith:vllm_chunks": ("source", {"store": "chunks_stored", "prefilled": "chunks_prefilled"},
                               "Document chunks of built prompts: served by the store, or prefilled and stored"),
    "cachesmith:vllm_tokens": ("kind", {"stored": "stored_tokens", "recomputed": "recomputed_tokens",
                                        "written": "written_tokens"},
                               "Tokens of built prompts: of stored chunks, recomputed by the plan, written to vLLM's cache"),
}


@dataclass
class ConnectorStats(KVConnectorStats):
    """Counts since the last report; `data` maps a stats key to its count."""

    def add(self, **counts: int) -> None:
        for key, value in counts.items():
            self.data[key] = self.data.get(key, 0) + int(value)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> ConnectorStats:
        self.data = dict(Counter(self.data) + Counter(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ConnectorPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {name: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
                         for name, (label, _, doc) in SERIES.items()}
        for name, (_, keys, _) in SERIES.items():  # every series exists from the start, at 0
            for labelvalues in per_engine_labelvalues.values():
                for value in keys:
                    self.counters[name].labels(*labelvalues, value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for name, (_, keys, _) in SERIES.items():
            for value, key in keys.items():
                if transfer_stats_data.get(key):
                    self.counters[name].labels(*labelvalues, value).inc(transfer_stats_data[key])
