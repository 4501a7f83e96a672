"""`cachesmith bench`: replay one setting's trace through the real engine once per (method, SLO
scale), on the replay clock, and summarize.

In: a `BenchConfig`, a pipeline and an output folder. Out: `runs/*.json` (per-request records and
stats of each run, reused when the same run is asked again: a stopped bench resumes),
`summary.json` (config, base SLO, rows incl. BestStatic, all records) and `summary.md`.
Before the runs: the base SLO (mean single-request full-prefill TTFT over a few requests, which
also warms the model up) and, with the packaged profile, this machine's speed factor.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from cachesmith.bench.metrics import best_static, summarize
from cachesmith.bench.setting import BenchConfig, build_requests, instances
from cachesmith.engine import Engine, EngineConfig, EngineStats
from cachesmith.instance import WorkloadInstance
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchShape, PlannerConfig, Profile
from cachesmith.calibration.packaged import REUSE_PROBE, find_profile, rescaled, reuse_ratio, speed_factor
from cachesmith.calibration.shadow import shadow_calibrator
from cachesmith.recompute import full_prefill
from cachesmith.request import RequestResult
from cachesmith.scheduler import SchedulerConfig
from cachesmith.workloads.prompts import instance_prompt


@dataclass
class BenchResult:
    config: BenchConfig
    base_slo_s: float
    speed_factor: float
    profile_source: str
    rows: list[dict]
    records: list[dict]
    reuse_factor: float | None = None  # the packaged profile's reuse-path factor (None: speed_factor's)

    def to_json(self) -> str:
        return json.dumps({"config": asdict(self.config), "base_slo_s": self.base_slo_s,
                           "speed_factor": self.speed_factor, "reuse_factor": self.reuse_factor,
                           "profile_source": self.profile_source,
                           "summary": self.rows, "records": self.records}, indent=1)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _alone(pipe: RagPipeline, insts: list[WorkloadInstance], plan) -> list[tuple[BatchShape, float, float]]:
    """Each instance run alone with `plan`: (its shape, the coverage it ran at, its TTFT)."""
    out = []
    for inst in insts:
        parts = instance_prompt(pipe, inst)
        ans = pipe.answer_parts(parts, plan, 1)
        shape = BatchShape((ans.num_context_tokens,), (ans.num_suffix_tokens,), (len(parts.prefix_ids),))
        out.append((shape, ans.num_recomputed / max(1, ans.num_context_tokens), ans.ttft_s))
    return out


def measure_base(pipe: RagPipeline, insts: list[WorkloadInstance], profile: Profile) -> tuple[float, float]:
    """(mean single-request full-prefill TTFT, measured/predicted speed factor of `profile`)."""
    plan = full_prefill(pipe.model.num_layers)
    _alone(pipe, insts[:1], plan)  # warm-up
    shapes, _, ttfts = zip(*_alone(pipe, insts, plan))
    return statistics.fmean(ttfts), speed_factor(profile, list(shapes), list(ttfts))


def reuse_probes(pipe: RagPipeline, insts: list[WorkloadInstance]) -> list[dict]:
    """Each instance run alone with the reuse probe (`calibration.packaged.REUSE_PROBE`): its shape,
    the coverage it ran at and its TTFT, from which `reuse_factor` prices any profile. Each reads
    its chunks from the store's slower tier, as a replay mostly does (`_cool`)."""
    _cool(pipe, insts)
    return [{"context": shape.context_tokens[0], "suffix": shape.suffix_tokens[0], "prefix": shape.prefix_tokens[0],
             "coverage": coverage, "seconds": seconds}
            for shape, coverage, seconds in _alone(pipe, insts, REUSE_PROBE)]


def _cool(pipe: RagPipeline, insts: list[WorkloadInstance]) -> None:
    """Store the instances' chunks, then drop them from the fastest tier wherever a slower tier keeps
    them. The default memory tier holds about ten MIX requests' chunks, so a replay reads most from
    disk; probes reading the chunks just stored read memory, and on a 2-core machine they ran
    2-16% faster than from the page-cached disk (ADR 0018, docs/adr/0018-cost-profile.md)."""
    for inst in insts:
        stored = pipe.stored_prompt(instance_prompt(pipe, inst))
        for key in [*stored.chunk_keys, *([stored.prefix_key] if stored.prefix_key else [])]:
            pipe.store.demote(key)


def reuse_factor(profile: Profile, probes: list[dict]) -> float:
    """Median measured / predicted TTFT of `reuse_probes` runs for `profile`."""
    return float(statistics.median(
        reuse_ratio(profile, BatchShape((p["context"],), (p["suffix"],), (p["prefix"],)), p["coverage"], p["seconds"])
        for p in probes))


def _base(pipe, config, insts, profile, source: str, out: Path,
          show_progress: bool) -> tuple[float, float, float | None]:
    """(base SLO, speed factor, reuse factor) of `profile` on this machine, measured once per `out`.
    The reuse factor is None (the speed factor's) where nothing is rescaled or base.json was
    written before the reuse probes were measured."""
    if config.base_slo_s is not None and source == "measured":
        return config.base_slo_s, 1.0, None  # nothing to measure: the SLO is given, the profile is this machine's
    path = out / "base.json"
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("digest") == config.digest():
            probes = saved.get("reuse_probes")
            return saved["base_slo_s"], saved["speed_factor"], reuse_factor(profile, probes) if probes else None
    sample = [i for i in insts if isinstance(i, WorkloadInstance)][: config.num_base_samples]
    if show_progress:
        print(f"measuring the base SLO: {len(sample)} single-request full prefills and reuse probes ...", flush=True)
    base, factor = measure_base(pipe, sample, profile)
    probes = reuse_probes(pipe, sample)
    if config.base_slo_s is not None:
        base = config.base_slo_s
    _atomic_write(path, json.dumps({"digest": config.digest(), "base_slo_s": base, "speed_factor": factor,
                                    "reuse_probes": probes}))
    return base, factor, reuse_factor(profile, probes)


def _run_one(pipe, profile, config: BenchConfig, insts, base: float, method: str, scale: float,
             references: dict[int, str], path: Path, show_progress: bool) -> tuple[list[dict], EngineStats]:
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        return saved["records"], EngineStats(**saved["stats"])
    sched = SchedulerConfig(max_batch_size=config.max_batch_size, kv_capacity_tokens=config.kv_capacity_tokens)
    engine = Engine(pipe, profile, EngineConfig(method, "replay", config.gate, sched,
                                                PlannerConfig(bandwidth_gbps=config.bandwidth_gbps),
                                                shadow_work=shadow_calibrator))
    engine.references = references
    requests, refused = build_requests(pipe, config, insts, base, scale)
    results = engine.run(requests, show_progress=show_progress)
    results += [RequestResult(i, a, s, "file", error=e, error_kind="invalid") for i, (a, s, e) in refused.items()]
    records = [{**r.to_dict(), "method": method, "slo_scale": scale}
               for r in sorted(results, key=lambda r: r.request_id)]
    _atomic_write(path, json.dumps({"records": records, "stats": asdict(engine.stats)}))
    return records, engine.stats


def run_bench(pipe: RagPipeline, config: BenchConfig, out: Path, profile_path: Path | None = None,
              show_progress: bool = True, workload_demand: Path | None = None,
              is_workload_demand_used: bool = True) -> BenchResult:
    """Every method of `config` at every SLO scale, each run cached under `out`. The profile is
    `find_profile`'s (with `workload_demand`: that workload demand file's curves; with
    `is_workload_demand_used=False`: the profile's own, whatever `cachesmith profile --workload`
    wrote)."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    profile, source = find_profile(pipe, profile_path, workload_demand, is_workload_demand_used)
    insts = instances(config)
    base, factor, reuse = _base(pipe, config, insts, profile, source, out, show_progress)
    if source == "packaged":
        profile = rescaled(profile, factor, reuse)
    methods = list(config.methods)
    if config.gate == "fidelity" and "full_prefill" not in methods:
        methods.insert(0, "full_prefill")  # its answers are the fidelity gate's references
    methods.sort(key=lambda m: m != "full_prefill")
    rows, records, references = [], [], {}
    runs = [(m, s) for s in config.slo_scales for m in methods]
    for method, scale in tqdm(runs, desc="bench runs", unit="run", disable=not show_progress):
        path = out / "runs" / f"{config.digest()}-{method.replace('@', '_')}-x{scale:g}.json"
        recs, stats = _run_one(pipe, profile, config, insts, base, method, scale, references, path, show_progress)
        if method == "full_prefill" and not references:
            references.update({r["request_id"]: r["answer"] for r in recs if r["error"] is None})
        rows.append(summarize(method, scale, recs, stats))
        records += recs
    rows += best_static(rows)
    result = BenchResult(config, base, factor, source, rows, records, reuse)
    _atomic_write(out / "summary.json", result.to_json())
    return result
