"""Serving methods by name: CacheSmith (SLO-aware scheduler + budget-aware planner) or a static
preset served first-come-first-served, optionally queue-aware.

Names: `cachesmith`, `full_prefill`, `full_reuse`, `<preset>@<coverage>` (e.g. `cacheblend@0.15`),
and a `+qa` suffix for the queue-aware FCFS baseline (`epic@0.3+qa`: requests past saving go to
full reuse). In: a name. Out: a `Method` and the scheduler that serves it.
"""
from __future__ import annotations

from dataclasses import dataclass

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.scheduler import FcfsQueueAware, FcfsStatic, Scheduler, SchedulerConfig, SloAwareScheduler

SELECTIVE = ("cacheblend", "epic", "prophetkv", "fusionrag")
DEFAULT_COVERAGES = (0.15, 0.3)


@dataclass(frozen=True)
class Method:
    name: str
    preset: str | None = None  # None: CacheSmith
    coverage: float = 0.0
    is_queue_aware: bool = False

    @property
    def is_static(self) -> bool:
        return self.preset is not None

    def plan(self, num_layers: int) -> RecomputeConfig:
        if self.preset is None:
            raise ConfigError(f"method {self.name!r} has no static plan")
        return preset(self.preset, self.coverage, num_layers)


def parse_method(name: str) -> Method:
    text = name.strip()
    is_qa = text.endswith("+qa")
    base = text.removesuffix("+qa")
    if base == "cachesmith":
        if is_qa:
            raise ConfigError("method 'cachesmith+qa': CacheSmith's scheduler is queue-aware already")
        return Method(text)
    if base in ("full_prefill", "full_reuse"):
        return Method(text, base, 1.0 if base == "full_prefill" else 0.0, is_qa)
    head, sep, cov = base.partition("@")
    if head not in SELECTIVE or not sep:
        raise ConfigError(f"method={name!r}: use cachesmith, full_prefill, full_reuse or <preset>@<coverage> "
                          f"with a preset of {', '.join(SELECTIVE)} (e.g. cacheblend@0.15), optionally +qa")
    try:
        coverage = float(cov)
    except ValueError:
        raise ConfigError(f"method={name!r}: coverage {cov!r} is not a number") from None
    if not 0 < coverage <= 1:
        raise ConfigError(f"method={name!r}: coverage {coverage} must be in (0, 1]")
    return Method(text, head, coverage, is_qa)


def default_methods(coverages: tuple[float, ...] = DEFAULT_COVERAGES) -> list[str]:
    """CacheSmith, the two extremes and every selective preset at each coverage."""
    return ["cachesmith", "full_prefill", "full_reuse"] + [f"{p}@{c:g}" for p in SELECTIVE for c in coverages]


def make_scheduler(method: Method, planner: Planner, config: SchedulerConfig, num_layers: int) -> Scheduler:
    if not method.is_static:
        return SloAwareScheduler(planner, config)
    cls = FcfsQueueAware if method.is_queue_aware else FcfsStatic
    return cls(method.plan(num_layers), planner.cost, config)

