"""The paper's evaluation on the simulator (§6.2–§6.3): the end-to-end grid and the ablations.

In: an `OutcomeTable` and this machine's `Profile`. Out: summary rows (the bench's metrics, plus
`study`, `task`, `pattern`, `cv`, `utilization`, `bandwidth_gbps`, `r_min`, `r_max`), one per
(study, setting, method, SLO scale), appended to a JSONL file as each run ends: a stopped grid
resumes where it stopped, with a progress bar over the runs. Studies:
- `grid`: PR, MSQ, VT, MV, MIX x Poisson at three utilizations and Gamma CV 2/2.5/3 x SLO 1-4x x
  every default method (BestStatic is chosen afterwards, in the report).
- `components`: each signal family's baseline, the planner alone, + SLO budgets, + scheduler.
- `signals`: CacheSmith against its two fixed-signal variants (PR, VT, MIX, PR+VT).
- `band`: budget floor x saturation point, CacheSmith on PR at CV 3.
- `bandwidth`: every method with the KV link capped (accuracy, QSA and stall fraction).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from cachesmith.bench.metrics import summarize
from cachesmith.bench.setting import BenchConfig
from cachesmith.errors import ConfigError
from cachesmith.jsonl import load_keyed
from cachesmith.methods import default_methods
from cachesmith.planner import PlannerConfig, Profile
from cachesmith.calibration.packaged import rescaled
from cachesmith.bench.outcomes import OutcomeTable
from cachesmith.bench.simulate import MAX_DECISION_S, base_slo, simulate_run
from cachesmith.bench.sim_executor import MachineNoise

TASKS = ("pr", "msq", "vt", "mv", "mix")
ARRIVALS = (("poisson", 1.0, 0.5), ("poisson", 1.0, 0.7), ("poisson", 1.0, 0.9),
            ("gamma", 2.0, 0.7), ("gamma", 2.5, 0.7), ("gamma", 3.0, 0.7))  # (pattern, CV, utilization)
SLO_SCALES = (1.0, 2.0, 3.0, 4.0)
COMPONENTS = ("cacheblend@0.15", "planner:cacheblend@0.15", "planner+slo:kv_dev", "cachesmith:kv_dev",
              "prophetkv@0.15", "planner:prophetkv@0.15", "planner+slo:qci", "cachesmith:qci")
SIGNAL_VARIANTS = ("cachesmith", "cachesmith:kv_dev", "cachesmith:qci", "cachesmith:entropy", "cachesmith+task",
                   "cachesmith+learn")
# beside the default methods in every grid setting: the task hint, the mix learned from verdicts,
# and the ablations the default must not trail (each fixed signal) or that it replaced (the paper's
# entropy rule)
GRID_VARIANTS = ("cachesmith+task", "cachesmith+learn", "cachesmith:kv_dev", "cachesmith:qci", "cachesmith:entropy")
BAND_FLOORS = (0.02, 0.05, 0.10)
BAND_SATURATIONS = (0.30, 0.50, 0.75)
BANDWIDTHS = (10.0, 6.0, 3.0, 1.0, 0.6, 0.3)  # GB/s: the paper's rungs, then the same / 10
STUDIES = ("grid", "components", "signals", "band", "bandwidth")


@dataclass(frozen=True)
class Run:
    study: str
    task: str
    pattern: str
    cv: float
    utilization: float
    slo_scale: float
    method: str
    bandwidth_gbps: float | None = None
    r_min: float = 0.05
    r_max: float = 0.50

    @property
    def key(self) -> str:
        return json.dumps([self.study, self.task, self.pattern, self.cv, self.utilization, self.slo_scale,
                           self.method, self.bandwidth_gbps, self.r_min, self.r_max])


@dataclass(frozen=True)
class GridConfig:
    num_requests: int = 200
    seed: int = 0
    max_batch_size: int = 8
    studies: tuple[str, ...] = ("grid", "components", "signals", "band", "bandwidth")
    methods: tuple[str, ...] = field(default_factory=lambda: tuple(default_methods()) + GRID_VARIANTS)
    tasks: tuple[str, ...] = TASKS
    arrivals: tuple[tuple[str, float, float], ...] = ARRIVALS
    slo_scales: tuple[float, ...] = SLO_SCALES
    bandwidths: tuple[float, ...] = BANDWIDTHS
    # the simulated machine's pace wanders batch to batch (`MachineNoise`); 0: it holds steady
    noise_sigma: float = 0.0
    noise_corr: float = 0.7
    pace_margin_z: float = PlannerConfig.pace_margin_z  # CacheSmith's plans sized for a slower pace
    # every scheduling and plan decision costs this many ms of virtual time, so a rerun repeats
    # row for row; None: their measured wall time (runs differ by a request here and there)
    decision_ms: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.studies) - set(STUDIES)
        if unknown:
            raise ConfigError(f"studies: unknown {', '.join(sorted(unknown))}; known: {', '.join(STUDIES)}")
        if self.num_requests < 1:
            raise ConfigError(f"num_requests={self.num_requests} must be >= 1")
        MachineNoise(self.noise_sigma, self.noise_corr)  # validates both
        if self.decision_ms is not None and not 0 <= self.decision_ms <= 1e3 * MAX_DECISION_S:
            raise ConfigError(f"decision_ms={self.decision_ms} must be in [0, {1e3 * MAX_DECISION_S:g}]")
        PlannerConfig(pace_margin_z=self.pace_margin_z)


def runs(config: GridConfig) -> Iterator[Run]:
    s = set(config.studies)
    if "grid" in s:
        for task in config.tasks:
            for pattern, cv, u in config.arrivals:
                for scale in config.slo_scales:
                    yield from (Run("grid", task, pattern, cv, u, scale, m) for m in config.methods)
    poisson, burst = ("poisson", 1.0, 0.7), ("gamma", 3.0, 0.7)
    if "components" in s:
        for task in ("pr", "vt", "mix"):
            for pattern, cv, u in (poisson, burst):
                yield from (Run("components", task, pattern, cv, u, 2.0, m) for m in COMPONENTS)
    if "signals" in s:
        for task in ("pr", "vt", "mix", "pr+vt"):
            for pattern, cv, u in (poisson, ("gamma", 2.0, 0.7), burst):
                yield from (Run("signals", task, pattern, cv, u, 2.0, m) for m in SIGNAL_VARIANTS)
    if "band" in s:
        for lo in BAND_FLOORS:
            for hi in BAND_SATURATIONS:
                yield Run("band", "pr", *burst, 2.0, "cachesmith", r_min=lo, r_max=hi)
    if "bandwidth" in s:
        for task in ("pr", "vt", "mix"):
            for gbps in config.bandwidths:
                yield from (Run("bandwidth", task, *poisson, 2.0, m, gbps) for m in config.methods if m not in GRID_VARIANTS)


def run_one(table: OutcomeTable, profile: Profile, config: GridConfig, run: Run, base_s: float,
            machine: dict | None = None) -> dict:
    bench = BenchConfig(run.task, None, None, config.num_requests, run.pattern, run.utilization, run.cv,
                        (run.slo_scale,), (run.method,), "task", config.seed, max_batch_size=config.max_batch_size,
                        bandwidth_gbps=run.bandwidth_gbps)
    planner = PlannerConfig(r_min=run.r_min, r_max=run.r_max, pace_margin_z=config.pace_margin_z)
    noise = MachineNoise(config.noise_sigma, config.noise_corr, config.seed) if config.noise_sigma else None
    decision_s = None if config.decision_ms is None else config.decision_ms / 1e3
    records, stats = simulate_run(table, profile, bench, base_s, run.method, run.slo_scale, planner, machine=machine,
                                  noise=noise, decision_s=decision_s)
    row = summarize(run.method, run.slo_scale, records, stats)
    return {**row, "key": run.key, "study": run.study, "task": run.task, "pattern": run.pattern, "cv": run.cv,
            "utilization": run.utilization, "bandwidth_gbps": run.bandwidth_gbps, "r_min": run.r_min,
            "r_max": run.r_max, "base_slo_s": base_s}


def _worker(args) -> dict:
    table_path, profile_path, factor, config, run, base_s, machine = args
    return run_one(*_load(table_path, profile_path, factor), config, run, base_s, machine)


_CACHE: dict = {}


def _load(table_path: str, profile_path: str, factor: float) -> tuple[OutcomeTable, Profile]:
    key = (table_path, profile_path, factor)
    if key not in _CACHE:
        _CACHE[key] = (OutcomeTable.load(Path(table_path)), rescaled(Profile.load(Path(profile_path)), factor))
    return _CACHE[key]


def simulator_machine(validation: Path | None, machine: Path | None) -> tuple[float, dict | None]:
    """(speed factor, machine paces) the simulator runs at: the simulator validation's measured
    payload, overlaid by the machine refit against the profile, each where its file exists."""
    measured = {}
    for path in (validation, machine):
        if path is not None and path.exists():
            measured.update(json.loads(path.read_text(encoding="utf-8")))
    return measured.get("speed_factor", 1.0), measured.get("machine") or measured.get("paces")


def run_grid(table_path: Path, profile_path: Path, speed_factor: float, out: Path, config: GridConfig,
             num_workers: int = 2, show_progress: bool = True, machine: dict | None = None) -> list[dict]:
    """Every run of the studies, resuming from `out` (JSONL rows); returns all rows. The rows are
    keyed by run, not by table, profile or machine: use a fresh `out` after changing those."""
    table, profile = _load(str(table_path), str(profile_path), speed_factor)
    done = load_keyed(out)
    todo = [r for r in runs(config) if r.key not in done]
    for task, method in dict.fromkeys((r.task, r.method) for r in todo):  # before any worker starts
        table.check_measured(method, table.by_task(task))
    base_s = base_slo(table, profile)  # one base for every link: the SLO stays as the link slows
    jobs = [(str(table_path), str(profile_path), speed_factor, config, r, base_s, machine) for r in todo]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(todo), desc="simulated runs", unit="run",
                                                    disable=not show_progress) as bar:
        pool = ProcessPoolExecutor(num_workers) if num_workers > 1 and jobs else None
        try:
            for row in pool.map(_worker, jobs, chunksize=4) if pool else map(_worker, jobs):
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[row["key"]] = row
                bar.update(1)
        finally:
            if pool:
                pool.shutdown()
    return [done[r.key] for r in runs(config)]
