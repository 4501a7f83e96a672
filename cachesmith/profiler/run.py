"""`cachesmith profile`: measure and write the planner's profile for one (model, dtype, device).

In: a `RagPipeline` and `ProfileConfig`. Out: the profile JSON (default
$CACHESMITH_HOME/profiles/<model>-<dtype>-<device>.json). Each part (costs, bandwidth, demand) is
saved as it completes and demand answers are cached per evaluation, so a stopped run resumes.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.model.assets import cachesmith_home
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import CostModel
from cachesmith.planner.profile import PhaseCost, Profile
from cachesmith.profiler.bandwidth import tier_bandwidth
from cachesmith.profiler.costs import HELD_OUT, default_shapes, fit_costs, measure, validation_error
from cachesmith.profiler.demand import DemandProfiler
from cachesmith.workloads.tasks import generate_many, resolve


@dataclass(frozen=True)
class ProfileConfig:
    num_requests: int = 200
    task: str = "pr"
    variant: str | None = None
    seed: int = 10_000  # profiling requests are drawn apart from evaluation seeds
    max_tokens: int = 4096  # largest batch (tokens) in the cost grid
    tiers: tuple[str, ...] = ("memory", "disk")
    redis_url: str | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ConfigError(f"num_requests={self.num_requests} must be >= 1")
        if self.max_tokens < 256:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 256")
        if self.task != "mix":
            resolve(self.task, self.variant)  # an unknown task or variant fails now, not after the costs


def default_path(pipe: RagPipeline) -> Path:
    dtype = str(pipe.model.dtype).removeprefix("torch.")
    return cachesmith_home() / "profiles" / f"{pipe.model.model_dir.name}-{dtype}-{pipe.model.device.type}.json"


def _part(out: Path, name: str, compute):
    path = out.with_name(out.stem + f".{name}.json")
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    value = compute()
    path.write_text(json.dumps(value, indent=1), encoding="utf-8")
    return value


def _costs(pipe: RagPipeline, config: ProfileConfig, show_progress: bool) -> dict:
    runs = measure(pipe.model, default_shapes(config.max_tokens), show_progress=show_progress)
    costs, overhead = fit_costs(runs)
    return {"layer_costs": {k: asdict(v) for k, v in costs.items()}, "overhead": asdict(overhead)}


def _validate(pipe: RagPipeline, profile: Profile, max_tokens: int) -> dict:
    model = CostModel(profile)
    shapes = [s for s in HELD_OUT if sum(s) <= max_tokens] or [(max_tokens * 3 // 4,), (max_tokens // 4,) * 2]

    def predict(shape, plan):
        cov = np.full(shape.num_requests, plan.coverage)
        return float(model.ttft(shape, plan.signal.value, plan.warmup, plan.probe, cov)[0])

    rows = validation_error(pipe.model, predict, shapes=shapes)
    errs = [r["rel_err"] for r in rows]
    return {"ttft_rel_err_mean": statistics.fmean(errs), "ttft_rel_err_max": max(errs), "rows": rows}


def run_profile(pipe: RagPipeline, config: ProfileConfig, out: Path | None = None,
                show_progress: bool = True) -> Profile:
    out = Path(out or default_path(pipe))
    out.parent.mkdir(parents=True, exist_ok=True)
    model = pipe.model
    dtype = str(model.dtype).removeprefix("torch.")
    costs = _part(out, "costs", lambda: _costs(pipe, config, show_progress))
    gbps = _part(out, "bandwidth", lambda: tier_bandwidth(model, config.tiers, redis_url=config.redis_url))
    cfg = model.config
    base = Profile(model.fingerprint, model.model_dir.name, dtype, model.device.type, model.num_layers,
                   2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize,
                   {k: PhaseCost(**v) for k, v in costs["layer_costs"].items()}, PhaseCost(**costs["overhead"]), gbps)
    validation = _part(out, "validation", lambda: _validate(pipe, base, config.max_tokens))
    insts = generate_many(config.task, config.num_requests, config.seed, config.variant)
    profiler = DemandProfiler(pipe, out.with_name(out.stem + ".demand.jsonl"))
    curves, theta, _ = profiler.run(insts, show_progress=show_progress)
    profile = Profile(**{**base.__dict__, "demand": curves, "entropy_threshold": theta,
                         "fit_error": {k: v for k, v in validation.items() if k != "rows"}})
    profile.save(out)
    return profile
