"""Serving methods by name: CacheSmith (SLO-aware scheduler + budget-aware planner) or a static
preset served first-come-first-served, optionally queue-aware.

Names: `cachesmith`, `full_prefill`, `full_reuse`, `<preset>@<coverage>` (e.g. `cacheblend@0.15`),
and a `+qa` suffix for the queue-aware FCFS baseline (`epic@0.3+qa`: requests past saving go to
full reuse). `cachesmith+task` plans each batch whose requests all name one task with that task's
demand curves (the request's `task` as a hint; plain `cachesmith` is hint-free, the paper's
setting); `cachesmith+learn` stays hint-free but prices plans with the served workload's demand
learned while serving: shadow samples of its own requests measured in idle time
(`calibration.shadow`, `planner.learned_demand`) and the quality verdicts of the requests it has
served (the server's come from clients, `POST /v1/feedback`); `cachesmith+task+learn` does both. The
ablations of paper §6.3 add `cachesmith:<signal>` (the selection signal fixed to `kv_dev` or
`qci`), `cachesmith:entropy` (the paper's entropy-threshold signal rule), `cachesmith:passes` (the
signal with the most expected passes under the served mix, without the robust rule's margin),
`planner:<preset>@<coverage>` (the planner alone: arrival-order batches under the preset's own
TTFT as a fixed budget, the preset's signal family) and `planner+slo:<signal>`
(arrival-order batches under budgets from the queue's deadlines). In: a name. Out: a `Method` and
the scheduler that serves it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cachesmith.errors import ConfigError
from cachesmith.planner import Planner, PlannerConfig
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.scheduler import (FcfsPlanned, FcfsQueueAware, FcfsSloBudget, FcfsStatic, Scheduler,
                                  SchedulerConfig, SloAwareScheduler)

SELECTIVE = ("cacheblend", "epic", "prophetkv", "fusionrag")
DEFAULT_COVERAGES = (0.15, 0.3)
SIGNAL_FAMILY = {"cacheblend": "kv_dev", "epic": "kv_dev", "prophetkv": "qci", "fusionrag": "qci"}
PLANNER_SIGNALS = ("kv_dev", "qci")
CACHESMITH_KINDS = ("cachesmith", "cachesmith+task", "cachesmith+learn", "cachesmith+task+learn")


@dataclass(frozen=True)
class Method:
    name: str
    preset: str | None = None  # None: CacheSmith
    coverage: float = 0.0
    is_queue_aware: bool = False
    signal: str | None = None  # the planner's selection signal, fixed (None: chosen per batch)
    scheduling: str = "slo_aware"  # "slo_aware", "fcfs" (static), "fcfs_planned" or "fcfs_slo"
    signal_rule: str = "robust"  # how the planner chooses the signal when it is not fixed
    use_task_hint: bool = False  # plan with the demand of the task the batch's requests name
    is_mix_learned: bool = False  # price hint-free batches with the mix learned from served verdicts

    @property
    def is_static(self) -> bool:
        return self.scheduling == "fcfs"

    def planner_config(self, base: PlannerConfig) -> PlannerConfig:
        """`base` with this method's signal (fixed, or the rule choosing it), task hint and learning."""
        return replace(base, signal=self.signal or base.signal, signal_rule=self.signal_rule,
                       use_task_hint=self.use_task_hint, is_mix_learned=self.is_mix_learned)

    def plan(self, num_layers: int) -> RecomputeConfig:
        if self.preset is None:
            raise ConfigError(f"method {self.name!r} has no static plan")
        return preset(self.preset, self.coverage, num_layers)


def _signal(name: str, signal: str) -> str:
    if signal not in PLANNER_SIGNALS:
        raise ConfigError(f"method={name!r}: signal {signal!r} must be one of {', '.join(PLANNER_SIGNALS)}")
    return signal


def parse_method(name: str) -> Method:
    text = name.strip()
    is_qa = text.endswith("+qa")
    base = text.removesuffix("+qa")
    kind, colon, arg = base.partition(":")
    if kind in (*CACHESMITH_KINDS, "planner", "planner+slo") and is_qa:
        raise ConfigError(f"method {name!r}: CacheSmith's scheduler is queue-aware already (no +qa)")
    if kind in ("planner", "planner+slo") and not colon:
        raise ConfigError(f"method {name!r}: needs ':<preset>@<coverage>' (planner) or ':<signal>' "
                          f"(planner+slo), e.g. planner:cacheblend@0.15")
    if kind in CACHESMITH_KINDS:
        hint, learn = "+task" in kind, kind.endswith("+learn")
        if arg in ("entropy", "passes"):
            return Method(text, signal_rule=arg, use_task_hint=hint, is_mix_learned=learn)
        return Method(text, signal=_signal(text, arg) if colon else None, use_task_hint=hint,
                      is_mix_learned=learn)
    if kind == "planner+slo":
        return Method(text, signal=_signal(text, arg), scheduling="fcfs_slo")
    if kind == "planner":
        static = parse_method(arg)
        if static.preset not in SIGNAL_FAMILY:
            raise ConfigError(f"method={name!r}: the planner alone needs a selective preset (e.g. cacheblend@0.15)")
        return Method(text, static.preset, static.coverage, signal=SIGNAL_FAMILY[static.preset],
                      scheduling="fcfs_planned")
    if base in ("full_prefill", "full_reuse"):
        return Method(text, base, 1.0 if base == "full_prefill" else 0.0, is_qa, scheduling="fcfs")
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
    return Method(text, head, coverage, is_qa, scheduling="fcfs")


def default_methods(coverages: tuple[float, ...] = DEFAULT_COVERAGES) -> list[str]:
    """CacheSmith, the two extremes and every selective preset at each coverage."""
    return ["cachesmith", "full_prefill", "full_reuse"] + [f"{p}@{c:g}" for p in SELECTIVE for c in coverages]


def make_scheduler(method: Method, planner: Planner, config: SchedulerConfig, num_layers: int) -> Scheduler:
    if method.scheduling == "slo_aware":
        return SloAwareScheduler(planner, config)
    if method.scheduling == "fcfs_slo":
        return FcfsSloBudget(planner, config)
    if method.scheduling == "fcfs_planned":
        return FcfsPlanned(method.plan(num_layers), planner.cost, config)
    cls = FcfsQueueAware if method.is_queue_aware else FcfsStatic
    return cls(method.plan(num_layers), planner.cost, config)

