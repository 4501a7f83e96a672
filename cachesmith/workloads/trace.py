"""Arrival traces: Poisson or Gamma arrivals (Gamma shape 1/CV^2, scale CV^2/rate: same mean rate,
burstier as CV grows), each request bound to a workload instance and given an SLO of base x scale.

In: a `TraceConfig`. Out: a `Trace` (config + `TraceRequest`s), saved and loaded as JSONL: a first
line `{"config": {...}}`, then one request per line. Seeded: the same config gives the same trace.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cachesmith.errors import ConfigError, InputError

PATTERNS = ("poisson", "gamma")


@dataclass(frozen=True)
class TraceConfig:
    pattern: str = "poisson"
    rate_rps: float = 0.5  # mean arrival rate, requests per second
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (gamma only; poisson is 1)
    num_requests: int = 100
    base_slo_s: float = 2.0  # mean single-request full-prefill TTFT on this machine
    slo_scale: float = 2.0  # every request's SLO = base x scale ...
    slo_scale_max: float | None = None  # ... or drawn uniformly in [slo_scale, slo_scale_max]
    task: str = "mix"  # workload the requests draw instances from ("file" for a user workload)
    variant: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ConfigError(f"pattern={self.pattern!r}: must be one of {', '.join(PATTERNS)}")
        for name in ("rate_rps", "cv", "base_slo_s", "slo_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.pattern == "poisson" and self.cv != 1.0:
            raise ConfigError(f"cv={self.cv}: a Poisson trace has CV 1; use pattern='gamma' for another CV")
        if self.num_requests < 1:
            raise ConfigError(f"num_requests={self.num_requests} must be >= 1")
        if self.slo_scale_max is not None and self.slo_scale_max < self.slo_scale:
            raise ConfigError(f"slo_scale_max={self.slo_scale_max} must be >= slo_scale={self.slo_scale}")


@dataclass(frozen=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    slo_s: float
    instance_seed: int  # the workload instance: generate(task, instance_seed, variant), or file line


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    requests: tuple[TraceRequest, ...]

    def interarrival_cv(self) -> float:
        gaps = np.diff([0.0] + [r.arrival_s for r in self.requests])
        return float(gaps.std() / gaps.mean())

    def mean_rate_rps(self) -> float:
        return len(self.requests) / self.requests[-1].arrival_s

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"config": asdict(self.config)}) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Trace":
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"trace file {path}: cannot be read ({exc})") from exc
        try:
            config = TraceConfig(**json.loads(lines[0])["config"])
            requests = tuple(TraceRequest(**json.loads(line)) for line in lines[1:] if line.strip())
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"trace file {path}: malformed ({exc})") from exc
        if len(requests) != config.num_requests:
            raise InputError(f"trace file {path}: {len(requests)} requests, config says {config.num_requests}")
        return cls(config, requests)


def rate_for_utilization(utilization: float, mean_service_s: float) -> float:
    """Arrival rate giving `utilization` = rate x mean single-request service time."""
    if not utilization > 0 or not mean_service_s > 0:
        raise ConfigError(f"utilization={utilization} and mean_service_s={mean_service_s} must be positive")
    return utilization / mean_service_s


def interarrival_gaps(config: TraceConfig, rng: np.random.Generator) -> np.ndarray:
    n = config.num_requests
    if config.pattern == "poisson":
        return rng.exponential(1.0 / config.rate_rps, n)
    shape = 1.0 / config.cv ** 2
    return rng.gamma(shape, config.cv ** 2 / config.rate_rps, n)


def make_trace(config: TraceConfig) -> Trace:
    rng = np.random.default_rng(config.seed)
    arrivals = np.cumsum(interarrival_gaps(config, rng))
    if config.slo_scale_max is None:
        scales = np.full(config.num_requests, config.slo_scale)
    else:
        scales = rng.uniform(config.slo_scale, config.slo_scale_max, config.num_requests)
    requests = tuple(TraceRequest(i, float(a), float(config.base_slo_s * s), config.seed * 100_003 + i)
                     for i, (a, s) in enumerate(zip(arrivals, scales)))
    return Trace(config, requests)
