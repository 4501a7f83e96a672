"""`cachesmith profile --workload FILE.jsonl`: the demand of the user's own requests.

In: a `RagPipeline`, a workload file (docs/workloads.md, "Workload files"; gold optional) and a gate: `fidelity`
(an answer passes when its canonical form equals full prefill's: no labels needed) or `task` (the
gold). Out: `<profile stem>.workload.json` beside the profile (`calibration.workload_demand`: demand
curves over the file's requests as the served mix, and per task where the file names several; the entropy threshold; the
file's digest, the gate and the time it took), which `find_profile` lays over the costs of whatever
profile serves (measured or packaged): costs depend on the machine, demand on the model and the
workload. Every verdict is appended to `<stem>.workload.verdicts.jsonl`, so a stopped run resumes.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

from cachesmith.calibration.demand import DemandProfiler
from cachesmith.calibration.workload_demand import DEFAULT_MAX_COVERAGE, PLANNED_FAMILIES, WorkloadDemand
from cachesmith.errors import InputError
from cachesmith.instance import WorkloadInstance, load_workload_file
from cachesmith.pipeline import RagPipeline
from cachesmith.profiler.subjects import instance_subject


def read_workload(path: Path, num_requests: int | None = None) -> tuple[list[WorkloadInstance], str]:
    """(the first `num_requests` requests of a workload file, the file's sha256). A line that
    cannot be read stops the profile, naming it: a demand curve must not drop requests silently."""
    lines = load_workload_file(str(path))
    bad = [line for line in lines if isinstance(line, str)]
    if bad:
        raise InputError(f"{len(bad)} line(s) of {path} cannot be profiled; first: {bad[0]}")
    if num_requests is not None:
        if num_requests < 1:
            raise InputError(f"num_requests={num_requests} must be >= 1")
        lines = lines[:num_requests]
    return lines, hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def default_gate(instances: list[WorkloadInstance]) -> str:
    """The task gate where every request brings gold, else fidelity (no labels needed)."""
    return "task" if all(inst.gold for inst in instances) else "fidelity"


def run_workload_demand(pipe: RagPipeline, workload: Path, out: Path, gate: str | None = None,
                        num_requests: int | None = None, show_progress: bool = True,
                        max_coverage: float | None = None) -> WorkloadDemand:
    """Measure the demand of the workload file's requests and save it at `out`. Flips above
    `max_coverage` (default: the planner's saturation coverage) are not searched for."""
    max_coverage = DEFAULT_MAX_COVERAGE if max_coverage is None else max_coverage
    instances, digest = read_workload(workload, num_requests)
    gate = gate or default_gate(instances)
    if gate == "task" and not all(inst.gold for inst in instances):
        raise InputError(f"{workload}: some requests have no gold answer, which the task gate needs; "
                         f"use the fidelity gate (--gate fidelity)")
    out.parent.mkdir(parents=True, exist_ok=True)
    profiler = DemandProfiler(pipe, out.with_name(out.stem + ".verdicts.jsonl"), gate=gate,
                              max_coverage=max_coverage)
    start = time.perf_counter()
    subjects = [instance_subject(pipe, inst) for inst in instances]
    curves, theta, _ = profiler.run(subjects, show_progress=show_progress, fixed_families=PLANNED_FAMILIES)
    demand = WorkloadDemand(pipe.model.fingerprint, str(pipe.model.dtype).removeprefix("torch."),
                            f"{Path(workload).name} sha256:{digest}", gate, len(instances), curves, theta,
                            time.perf_counter() - start, max_coverage)
    demand.save(out)
    return demand
