"""`cachesmith profile`: measure and write the planner's profile for one (model, dtype, device).

In: a `RagPipeline` and `ProfileConfig`. Out: the profile JSON (default
$CACHESMITH_HOME/profiles/<model>-<dtype>-<device>.json, `-<codec>` before `.json` where the
pipeline's store encodes its KV): its costs and bandwidths measured as
`calibration.cost_run` measures them, its demand distributions and entropy threshold measured on
`config.num_requests` requests of the task `config.task` (default: the served mix). Demand answers
are cached per evaluation in `<stem>.demand.jsonl`, so a stopped run resumes. `run_demand_profile`
measures the demand alone and takes the costs from a profile of the same model, dtype and device:
costs depend on the machine, demand on the model and on how its stored KV is encoded.
"""
from __future__ import annotations

from pathlib import Path

from cachesmith.calibration.cost_run import ProfileConfig, base_profile, codec_path, demand_source_path, fit_error
from cachesmith.calibration.demand import DemandProfiler
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import Profile, ProfileError
from cachesmith.profiler.subjects import instance_subject
from cachesmith.workloads.tasks import generate_many, resolve


def run_profile(pipe: RagPipeline, config: ProfileConfig, out: Path | None = None,
                show_progress: bool = True) -> Profile:
    _check_task(config)
    out = Path(out or codec_path(pipe))  # a store that encodes KV: demand on decoded KV, kept apart
    base, validation = base_profile(pipe, config, out, show_progress)
    return _with_demand(pipe, config, out, Profile(**{**base.__dict__, "fit_error": fit_error(validation)}),
                        show_progress)


def run_demand_profile(pipe: RagPipeline, config: ProfileConfig, out: Path | None = None,
                       costs_from: Path | None = None, show_progress: bool = True) -> Profile:
    """Demand (and entropy threshold) measured on `pipe`, whose store may encode its KV; costs,
    bandwidths and their fit error from `costs_from`, else the profile packaged for this model,
    dtype and device. Nothing is timed, so a busy machine changes nothing it writes."""
    _check_task(config)
    out = Path(out or codec_path(pipe))
    source = Path(costs_from) if costs_from is not None else demand_source_path(pipe)
    if not source.exists():
        raise ProfileError(f"no profile at {source} to take the costs from; give --costs-from, or run "
                           f"`cachesmith profile` (costs and demand)")
    dtype = str(pipe.model.dtype).removeprefix("torch.")
    base = Profile.load(source, pipe.model.fingerprint, dtype, pipe.model.device.type)  # names what differs
    return _with_demand(pipe, config, out, base, show_progress)


def _check_task(config: ProfileConfig) -> None:
    if config.task != "mix":
        resolve(config.task, config.variant)  # an unknown task or variant fails now, not after the costs


def _with_demand(pipe: RagPipeline, config: ProfileConfig, out: Path, base: Profile, show_progress: bool) -> Profile:
    insts = generate_many(config.task, config.num_requests, config.seed, config.variant)
    profiler = DemandProfiler(pipe, out.with_name(out.stem + ".demand.jsonl"))
    curves, theta, _ = profiler.run([instance_subject(pipe, i) for i in insts], show_progress=show_progress)
    profile = Profile(**{**base.__dict__, "demand": curves, "entropy_threshold": theta})
    profile.save(out)
    return profile
