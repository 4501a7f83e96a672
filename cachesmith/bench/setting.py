"""One bench setting: the workload (a task, MIX or a workload file), the arrival trace (Poisson at
a target utilization, or Gamma with a CV), the SLO scales and the methods compared.

In: a `BenchConfig` and the measured base SLO (mean single-request full-prefill TTFT). Out: the
`Request`s of one SLO scale (same arrivals and instances at every scale), and the refusals of
workload-file lines that could not be read (reported per request, the rest of the run goes on).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cachesmith.errors import ConfigError, InputError
from cachesmith.methods import default_methods, parse_method
from cachesmith.pipeline import RagPipeline
from cachesmith.request import Request, check_fits, check_slo
from cachesmith.scoring import Expected
from cachesmith.instance import WorkloadInstance, load_workload_file
from cachesmith.workloads.tasks import generate
from cachesmith.workloads.trace import PATTERNS, TraceConfig, make_trace, rate_for_utilization
from cachesmith.workloads.prompts import instance_prompt


@dataclass(frozen=True)
class BenchConfig:
    task: str = "mix"  # a task of `cachesmith workload card`, "mix", or "file" with workload_file
    variant: str | None = None
    workload_file: str | None = None  # JSONL, one instance per line (docs/workloads.md, "Workload files")
    num_requests: int = 40
    pattern: str = "poisson"
    utilization: float = 0.7  # arrival rate x mean single-request full-prefill TTFT
    cv: float = 1.0  # Gamma only
    slo_scales: tuple[float, ...] = (2.0,)
    methods: tuple[str, ...] = field(default_factory=lambda: tuple(default_methods()))
    gate: str = "task"
    seed: int = 0
    base_slo_s: float | None = None  # None: measured on this machine before the runs
    num_base_samples: int = 8  # single-request full prefills that measure the base SLO
    max_batch_size: int = 8
    kv_capacity_tokens: int = 65_536
    bandwidth_gbps: float | None = None  # cap the KV link (None: as fast as the store reads)

    def __post_init__(self) -> None:
        if self.workload_file is not None and self.task != "file":
            object.__setattr__(self, "task", "file")
        if self.task == "file" and not self.workload_file:
            raise ConfigError("task='file' needs workload_file")
        if self.pattern not in PATTERNS:
            raise ConfigError(f"pattern={self.pattern!r}: must be one of {', '.join(PATTERNS)}")
        if self.pattern == "poisson" and self.cv != 1.0:
            raise ConfigError(f"cv={self.cv}: Poisson arrivals have CV 1; use pattern='gamma'")
        for name in ("num_requests", "num_base_samples", "max_batch_size", "kv_capacity_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("utilization", "cv"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if not self.slo_scales or any(not s > 0 for s in self.slo_scales):
            raise ConfigError(f"slo_scales={self.slo_scales}: need at least one, all positive")
        if not self.methods:
            raise ConfigError("methods: need at least one")
        for m in self.methods:
            parse_method(m)
        if self.base_slo_s is not None and not self.base_slo_s > 0:
            raise ConfigError(f"base_slo_s={self.base_slo_s} must be positive")

    @property
    def name(self) -> str:
        work = Path(self.workload_file).stem if self.task == "file" else (
            self.task + (f"-{self.variant}" if self.variant else ""))
        arrivals = f"poisson-u{self.utilization:g}" if self.pattern == "poisson" else f"gamma-cv{self.cv:g}-u{self.utilization:g}"
        return f"{work}-{arrivals}-n{self.num_requests}-s{self.seed}"

    def digest(self) -> str:
        """What a cached run depends on (not the method list or the scales: runs are per both)."""
        keep = {k: v for k, v in asdict(self).items() if k not in ("methods", "slo_scales")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _gated(line: WorkloadInstance | str, gate: str) -> WorkloadInstance | str:
    """A line without gold cannot be judged by the task gate: refused by name, not failed silently."""
    if isinstance(line, WorkloadInstance) and gate == "task" and not line.gold:
        return f"{line.name}: no gold answer, which the task gate needs (use the fidelity gate: --gate fidelity)"
    return line


def trace_config(config: BenchConfig, base_slo_s: float, slo_scale: float) -> TraceConfig:
    return TraceConfig(config.pattern, rate_for_utilization(config.utilization, base_slo_s), config.cv,
                       config.num_requests, base_slo_s, slo_scale, None,
                       config.task, config.variant, config.seed)


def instances(config: BenchConfig) -> list[WorkloadInstance | str]:
    """The instance behind each request id (an error string for an unreadable file line)."""
    if config.task == "file":
        lines = [_gated(line, config.gate) for line in load_workload_file(config.workload_file)]
        return [lines[i % len(lines)] for i in range(config.num_requests)]
    trace = make_trace(trace_config(config, 1.0, 1.0))
    return [generate(config.task, r.instance_seed, config.variant) for r in trace.requests]


def build_requests(pipe: RagPipeline, config: BenchConfig, insts: list[WorkloadInstance | str], base_slo_s: float,
                   slo_scale: float) -> tuple[list[Request], dict[int, tuple[float, float, str]]]:
    """(requests, refusals {request id: (arrival, slo, error)}) of one SLO scale. Each instance's
    prompt is tokenized, keyed and stored here (a miss is prefilled), as a server does before it
    queues a request: the engine runs the keys."""
    trace = make_trace(trace_config(config, base_slo_s, slo_scale))
    requests, refused = [], {}
    for r, inst in zip(trace.requests, insts):
        try:
            if isinstance(inst, str):
                raise InputError(inst)
            requests.append(instance_request(pipe, r.request_id, inst, r.slo_s, r.arrival_s))
        except InputError as exc:
            refused[r.request_id] = (r.arrival_s, r.slo_s, str(exc))
    return requests, refused


def instance_request(pipe: RagPipeline, request_id: int, inst: WorkloadInstance, slo_s: float,
                     arrival_s: float = 0.0) -> Request:
    """The engine `Request` of one workload instance: its prompt tokenized, keyed and stored (a miss
    is prefilled), its answer length, and its task and gold for the gate: a benchmark's requests
    enter here, so each rule of every request is checked here, before anything is stored. Raises
    `InputError` (its SLO, a prompt past the model's positions; an instance checks its own answer
    length)."""
    check_slo(slo_s, f"request {request_id}: slo_s")
    parts = instance_prompt(pipe, inst)
    check_fits(len(parts.token_ids), inst.max_new_tokens, pipe.model.config.max_positions, f"request {request_id}")
    return Request(request_id, pipe.stored_prompt(parts), slo_s, inst.max_new_tokens, arrival_s,
                   expected=Expected.of(inst))
