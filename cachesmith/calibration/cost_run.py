"""The costs half of a profile: measure one (model, dtype, device)'s layer costs and tier bandwidths.

In: a `RagPipeline` and `ProfileConfig`. Out: a profile JSON (default
$CACHESMITH_HOME/profiles/<model>-<dtype>-<device>.json) whose costs are measured here and whose
demand distributions and entropy threshold come from another profile (the packaged one by
default), its rank depths mapped onto this model's layers: costs depend on the machine, demand on
the model. Each part (bandwidth, costs, validation) is saved as it completes and every timed cost
run is appended to `<stem>.runs.jsonl`, so a stopped run resumes. The cost runs go through the
serving path (the transfer engine staging stored chunk KV from a store kept in `<stem>.kv/`). A
server runs this at its first start for a model nothing is packaged for (`QUICK_COSTS`);
`cachesmith profile` (`profiler.run`) adds demand measured on a workload.
"""
from __future__ import annotations

import functools
import json
import logging
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.model.assets import cachesmith_home
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import CostModel
from cachesmith.planner.profile import DemandCurve, PhaseCost, Profile, ProfileError
from cachesmith.calibration.bandwidth import tier_bandwidth
from cachesmith.calibration.cost_grid import default_grid
from cachesmith.calibration.costs import (HELD_OUT, TimingBench, fit_costs, measure, relative_errors,
                                       scaffold, process_factors, validation_error)
from cachesmith.calibration.mapped_demand import PACKAGED_DIR, REFERENCE_PROFILE, read_demand_source
from cachesmith.calibration.quiet import QuietRun
from cachesmith.recompute import full_prefill


@dataclass(frozen=True)
class ProfileConfig:
    num_requests: int = 200
    task: str = "mix"  # demand of the served mix (and of each of its tasks)
    variant: str | None = None
    seed: int = 10_000  # profiling requests are drawn apart from evaluation seeds
    max_tokens: int = 16_384  # largest batch (tokens) in the cost grid
    num_shapes: int = 36  # batch shapes in the cost grid (each runs `plans_per_shape` plans)
    plans_per_shape: int = 6
    num_pool_chunks: int = 96  # stored random-token chunks the cost runs' requests draw from
    tiers: tuple[str, ...] = ("memory", "disk")
    redis_url: str | None = None
    quiet_max_busy: float | None = None  # wait before each timed cost run until the machine is this idle

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ConfigError(f"num_requests={self.num_requests} must be >= 1")
        if self.max_tokens < 256:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 256")
        for name in ("num_shapes", "plans_per_shape", "num_pool_chunks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.quiet_max_busy is not None and not 0 < self.quiet_max_busy <= 1:
            raise ConfigError(f"quiet_max_busy={self.quiet_max_busy} must be in (0, 1] (a fraction of all cores)")

    def gate(self):
        """What runs before each timed cost run: a wait for a quiet machine, or nothing."""
        if self.quiet_max_busy is None:
            return None
        return functools.partial(QuietRun, self.quiet_max_busy, max_wait_s=600.0)


# what a serving run measures when no profile fits the loaded model: a small cost grid on the memory
# tier, 18 timed batches of at most 2K tokens and 8 held-out ones. For the packaged model on 2 busy
# cores: 42 s of timed runs, 2 min in all with the chunk pool and bandwidth; a tiny test model: 1 s.
# Kept this small so a GPU, timing the same shapes, stays well under a minute (not yet measured there).
# Demand comes from elsewhere (`run_costs_profile`)
QUICK_COSTS = ProfileConfig(num_requests=1, max_tokens=2048, num_shapes=6, plans_per_shape=3,
                            num_pool_chunks=16, tiers=("memory",))


def default_path(pipe: RagPipeline) -> Path:
    dtype = str(pipe.model.dtype).removeprefix("torch.")
    return cachesmith_home() / "profiles" / f"{pipe.model.model_dir.name}-{dtype}-{pipe.model.device.type}.json"


def codec_path(pipe: RagPipeline) -> Path:
    """Where the profile of a pipeline whose store encodes its KV (`StoreConfig.codec`) lives: its
    demand is measured on decoded KV, so it is kept apart, as `<model>-<dtype>-<device>-<codec>.json`
    (`default_path` for the exact store)."""
    path, codec = default_path(pipe), pipe.store.config.codec
    return path if codec == "none" else path.with_name(f"{path.stem}-{codec}{path.suffix}")


log = logging.getLogger(__name__)
PART_SUFFIXES = (".bandwidth.json", ".costs.json", ".validation.json", ".runs.jsonl", ".demand.jsonl", ".kv")


def _own_parts(out: Path, pipe: RagPipeline) -> None:
    """Saved parts beside `out` resume a stopped profile only of the same model, dtype and device:
    a model changed under the same name (new weights in the same folder) would otherwise be priced
    with the old one's timings. Parts of another, or of unknown origin, are removed first (logged)."""
    model = pipe.model
    identity = {"model_fingerprint": model.fingerprint, "dtype": str(model.dtype).removeprefix("torch."),
                "device": model.device.type}
    marker = out.with_name(out.stem + ".parts.json")
    try:
        if json.loads(marker.read_text(encoding="utf-8")) == identity:
            return
    except (OSError, ValueError):
        pass  # no marker (a fresh start, or parts saved without one) or an unreadable one
    stale = [p for p in (out.with_name(out.stem + suffix) for suffix in PART_SUFFIXES) if p.exists()]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if stale:
        log.warning("profile parts beside %s were saved for another model (or before they named theirs): "
                    "removed %d, measuring afresh", out, len(stale))
    marker.write_text(json.dumps(identity), encoding="utf-8")


def _part(out: Path, name: str, compute):
    path = out.with_name(out.stem + f".{name}.json")
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    value = compute()
    path.write_text(json.dumps(value, indent=1), encoding="utf-8")
    return value


def _grid_limits(max_tokens: int, max_positions: int) -> dict:
    """Context range and chunk sizes of a grid capped at `max_tokens` a batch (toy sizes in tests),
    each request within the model's `max_positions`: a request's context overshoots its target by
    up to one pool chunk (at most min(512, max_context) tokens), and prefix and suffix take 80."""
    room = max_positions - 80
    hi = min(4096, max_tokens - 80, max(room - 512, room // 2))
    return {"min_context": min(400, max(32, hi // 2)), "max_context": hi}


def _bench(pipe: RagPipeline, config: ProfileConfig, out: Path, show_progress: bool) -> TimingBench:
    limits = _grid_limits(config.max_tokens, pipe.model.config.max_positions)
    return TimingBench(pipe.model, out.with_name(out.stem + ".kv"), config.num_pool_chunks,
                       chunk_tokens=(min(96, limits["min_context"]), min(512, limits["max_context"])),
                       show_progress=show_progress)


def _costs(pipe: RagPipeline, config: ProfileConfig, out: Path, gbps: dict[str, float], bench_of,
           show_progress: bool) -> dict:
    specs = default_grid(config.max_tokens, config.num_shapes, config.plans_per_shape,
                         **_grid_limits(config.max_tokens, pipe.model.config.max_positions))
    start = time.perf_counter()
    runs = measure(bench_of(), specs, out.with_name(out.stem + ".runs.jsonl"), show_progress=show_progress,
                   gate=config.gate())
    model = pipe.model
    costs, overhead = fit_costs(runs, model.num_layers)
    fitted = scaffold(costs, overhead, model.num_layers, kv_bytes_per_token_layer(pipe),
                      max(gbps.values(), default=10.0))
    factors = process_factors(runs, fitted)
    errs = np.abs(relative_errors([r.scaled(factors[r.process]) for r in runs], fitted))
    return {"layer_costs": {k: asdict(v) for k, v in costs.items()}, "overhead": asdict(overhead),
            "grid": {"num_runs": len(runs), "max_tokens": config.max_tokens, "num_shapes": config.num_shapes,
                     "plans_per_shape": config.plans_per_shape, "measured_s": sum(r.total_s for r in runs),
                     "wall_s": time.perf_counter() - start, "process_factors": factors,
                     "fit_median_abs_rel_err": float(np.median(errs)),
                     "fit_p90_abs_rel_err": float(np.quantile(errs, 0.9))}}


def kv_bytes_per_token_layer(pipe: RagPipeline) -> int:
    cfg = pipe.model.config
    return 2 * cfg.num_kv_heads * cfg.head_dim * pipe.model.dtype.itemsize


def _validate(bench: TimingBench, profile: Profile, config: ProfileConfig) -> dict:
    """Held-out shapes: the error as measured, and at the measuring machine's speed (the profile rescaled by
    its single-request full prefills, as a packaged profile is served: `packaged.speed_factor`)."""
    max_tokens = config.max_tokens
    limits = _grid_limits(max_tokens, bench.model.config.max_positions)
    shapes = [s for s in HELD_OUT if sum(s) + 80 * len(s) <= max_tokens and max(s) <= limits["max_context"]] or \
        [(limits["max_context"] * 3 // 4,), (limits["max_context"] // 4,) * 2]
    rows = validation_error(bench, CostModel(profile), shapes=shapes, gate=config.gate())
    errs = [r["rel_err"] for r in rows]
    full = full_prefill(profile.num_layers).label()
    single = [r["measured_s"] / r["predicted_s"] for r in rows if r["plan"] == full and len(r["contexts"]) == 1]
    factor = statistics.median(single) if single else 1.0
    rescaled = [abs(factor * r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    return {"ttft_rel_err_mean": statistics.fmean(errs), "ttft_rel_err_max": max(errs), "speed_factor": factor,
            "rescaled_ttft_rel_err_mean": statistics.fmean(rescaled), "rescaled_ttft_rel_err_max": max(rescaled),
            "rows": rows}


def base_profile(pipe: RagPipeline, config: ProfileConfig, out: Path, show_progress: bool) -> tuple[Profile, dict]:
    """The profile without demand (costs, bandwidth) and its held-out validation."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _own_parts(out, pipe)
    model = pipe.model
    dtype = str(model.dtype).removeprefix("torch.")
    benches: list[TimingBench] = []

    def bench_of() -> TimingBench:  # built on first use: a resumed profile may need none
        if not benches:
            benches.append(_bench(pipe, config, out, show_progress))
        return benches[0]

    try:
        num_tokens = min(2048, model.config.max_positions)  # one chunk, within the model's positions
        gbps = _part(out, "bandwidth", lambda: tier_bandwidth(model, config.tiers, num_tokens,
                                                              redis_url=config.redis_url))
        costs = _part(out, "costs", lambda: _costs(pipe, config, out, gbps, bench_of, show_progress))
        base = Profile(model.fingerprint, model.model_dir.name, dtype, model.device.type, model.num_layers,
                       kv_bytes_per_token_layer(pipe), {k: PhaseCost(**v) for k, v in costs["layer_costs"].items()},
                       PhaseCost(**costs["overhead"]), gbps)
        validation = _part(out, "validation", lambda: _validate(bench_of(), base, config))
    finally:
        for b in benches:
            b.close()
    return base, validation


def fit_error(validation: dict) -> dict:
    return {k: v for k, v in validation.items() if k != "rows"}


def read_demand(path: Path) -> tuple[tuple[DemandCurve, ...], float]:
    """(demand curves, entropy threshold) of a profile file of any format version, at the depths
    it was measured at (`mapped_demand.DemandSource.onto` maps them onto another model's)."""
    source = read_demand_source(path)
    return source.curves, source.entropy_threshold


def demand_source_path(pipe: RagPipeline, demand_from: Path | None = None) -> Path:
    """Where a costs-only profile takes its demand: `demand_from`, else the profile packaged for
    this model, dtype and device, else the packaged model's (`REFERENCE_PROFILE`)."""
    if demand_from is not None:
        return Path(demand_from)
    own = PACKAGED_DIR / default_path(pipe).name
    return own if own.exists() else REFERENCE_PROFILE


def run_costs_profile(pipe: RagPipeline, config: ProfileConfig, out: Path | None = None,
                      demand_from: Path | None = None, show_progress: bool = True) -> Profile:
    """Re-measure costs (and bandwidth) only; demand and entropy threshold come from
    `demand_source_path(pipe, demand_from)`, its rank depths mapped onto this model's layers
    (`mapped_demand.map_demand_depths`), so no curve names a depth the model does not have."""
    out = Path(out or default_path(pipe))
    source = demand_source_path(pipe, demand_from)
    if not source.exists():
        raise ProfileError(f"no profile at {source} to take the demand distributions from; give another "
                           f"--demand-from, or run `cachesmith profile` (costs and demand)")
    demand = read_demand_source(source)  # read before the costs: a bad file fails now
    base, validation = base_profile(pipe, config, out, show_progress)
    curves, theta = demand.onto(base.num_layers)
    profile = Profile(**{**base.__dict__, "demand": curves, "entropy_threshold": theta,
                         "fit_error": fit_error(validation)})
    profile.save(out)
    return profile


__all__ = ["QUICK_COSTS", "ProfileConfig", "base_profile", "codec_path", "default_path", "demand_source_path", "read_demand",
           "run_costs_profile"]
