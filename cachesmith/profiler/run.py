"""`cachesmith profile`: measure and write the planner's profile for one (model, dtype, device).

In: a `RagPipeline` and `ProfileConfig`. Out: the profile JSON (default
$CACHESMITH_HOME/profiles/<model>-<dtype>-<device>.json, `-<codec>` before `.json` where the
pipeline's store encodes its KV): its costs and bandwidths measured as
`calibration.cost_run` measures them, its demand distributions and entropy threshold measured on
`config.num_requests` requests of the task `config.task` (default: the served mix). Demand answers
are cached per evaluation in `<stem>.demand.jsonl`, so a stopped run resumes.
"""
from __future__ import annotations

from pathlib import Path

from cachesmith.calibration.cost_run import ProfileConfig, base_profile, codec_path, fit_error
from cachesmith.calibration.demand import DemandProfiler
from cachesmith.pipeline import RagPipeline
from cachesmith.planner.profile import Profile
from cachesmith.profiler.subjects import instance_subject
from cachesmith.workloads.tasks import generate_many, resolve


def run_profile(pipe: RagPipeline, config: ProfileConfig, out: Path | None = None,
                show_progress: bool = True) -> Profile:
    if config.task != "mix":
        resolve(config.task, config.variant)  # an unknown task or variant fails now, not after the costs
    out = Path(out or codec_path(pipe))  # a store that encodes KV: demand on decoded KV, kept apart
    base, validation = base_profile(pipe, config, out, show_progress)
    insts = generate_many(config.task, config.num_requests, config.seed, config.variant)
    profiler = DemandProfiler(pipe, out.with_name(out.stem + ".demand.jsonl"))
    curves, theta, _ = profiler.run([instance_subject(pipe, i) for i in insts], show_progress=show_progress)
    profile = Profile(**{**base.__dict__, "demand": curves, "entropy_threshold": theta,
                         "fit_error": fit_error(validation)})
    profile.save(out)
    return profile
