"""Validate the simulator against the replay clock (issue #8): the same MIX traces served by the
real engine on the replay clock and by the simulator (cost-model time, outcome-table verdicts).

Settings: one Poisson and two bursty (Gamma CV 2 and 3) traces at the same utilization, each with
CacheSmith and a static baseline. Both sides share the instances (the table's measured ones,
written as a workload file whose lines the requests cycle through), the base SLO and the profile
(rescaled by the speed factor the replay bench measured). The simulator's machine runs each plan
family at this machine's pace (`bench.pace`), calibrated on a replay of a trace of its own (Gamma
CV 2.5, another seed): measured/predicted TTFT of its batches per family, single and in batches of
several, else the pace of single requests measured here scaled to the trace's level. All three
validation settings are held out. The replay runs
are cached under --out (a stopped run resumes). Bars: |QSA difference| <= 3 points and P99 TTFT
within 10%. Rows: setting, method, qsa_replay, qsa_sim, p99_replay_s, p99_sim_s, their gaps, and
attainment and gate rate of both. `--json` prints the payload; `--out-json FILE` writes it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, print_table  # noqa: E402

from cachesmith.bench import BenchConfig, run_bench  # noqa: E402
from cachesmith.bench.pace import combine_paces, measure_paces, trace_paces  # noqa: E402
from cachesmith.pipeline import RagPipeline  # noqa: E402
from cachesmith.workloads.tasks import generate  # noqa: E402
from cachesmith.profiler.packaged import find_profile, rescaled  # noqa: E402
from cachesmith.bench.outcomes import OutcomeTable, default_table_path  # noqa: E402
from cachesmith.bench.simulate import simulate  # noqa: E402

SETTINGS = (("poisson", 1.0), ("gamma", 2.0), ("gamma", 3.0))
CALIBRATION = ("gamma", 2.5, 1)  # (pattern, CV, seed): a trace of its own, so every setting is held out
COLUMNS = ["setting", "method", "qsa_replay", "qsa_sim", "qsa_diff_pts", "p99_replay_s", "p99_sim_s",
           "p99_rel_err", "att_replay", "att_sim", "gate_replay", "gate_sim", "is_within"]


def compare(replay: dict, sim: dict, setting: str) -> dict:
    diff = 100 * (sim["qsa"] - replay["qsa"])
    rel = sim["ttft_p99_s"] / replay["ttft_p99_s"] - 1
    return {"setting": setting, "method": replay["method"], "qsa_replay": replay["qsa"], "qsa_sim": sim["qsa"],
            "qsa_diff_pts": diff, "p99_replay_s": replay["ttft_p99_s"], "p99_sim_s": sim["ttft_p99_s"],
            "p99_rel_err": rel, "att_replay": replay["ttft_attainment"], "att_sim": sim["ttft_attainment"],
            "gate_replay": replay["gate_rate"], "gate_sim": sim["gate_rate"],
            "is_within": abs(diff) <= 3.0 and abs(rel) <= 0.10}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--methods", default="cachesmith,cacheblend@0.15")
    ap.add_argument("--table", type=Path, default=None, help="outcome table (default: the measured one)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/sim_validation"), help="replay runs (cached)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args()

    pipe = RagPipeline()
    table = OutcomeTable.load(args.table or default_table_path(pipe))
    methods = tuple(args.methods.split(","))
    workload = args.out / "measured-instances.jsonl"
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text("".join(generate("mix", o.seed).to_json() + "\n" for o in table.outcomes), encoding="utf-8")

    def config_of(pattern: str, cv: float, seed: int = 0) -> BenchConfig:
        return BenchConfig("file", None, str(workload), args.num_requests, pattern, args.utilization, cv,
                           (args.slo_scale,), methods, "task", seed)

    # calibrate the simulator's machine on a trace of its own: each plan family's pace, single and
    # in batches of several, as the replay ran it (other families: single requests timed here)
    calib_config = config_of(*CALIBRATION)
    calib_run = run_bench(pipe, calib_config, args.out / calib_config.name)
    profile, source = find_profile(pipe)
    if source == "packaged":
        profile = rescaled(profile, calib_run.speed_factor)
    isolated = measure_paces(pipe, profile, [generate("mix", o.seed) for o in table.outcomes[:4]],
                             args.out / "paces.json")
    in_trace = trace_paces(calib_run.records, table.outcomes, profile, is_by_size=True)
    paces = combine_paces(isolated, in_trace)
    calibration = {"setting": calib_config.name, "isolated": isolated,
                   "in_trace": {k: statistics.median(v) for k, v in in_trace.items()}}
    rows, factors, bases, by_setting = [], [], [], {}
    for pattern, cv in SETTINGS:
        config = config_of(pattern, cv)
        replay = run_bench(pipe, config, args.out / config.name)
        factors.append(replay.speed_factor)
        bases.append(replay.base_slo_s)
        sim = simulate(table, profile, config, replay.base_slo_s, pool=table.outcomes, paces=paces)
        by_size = trace_paces(replay.records, table.outcomes, profile, is_by_size=True)  # what the sim misses
        by_setting[config.name] = {k: {"median": statistics.median(v), "num_batches": len(v)} for k, v in by_size.items()}
        by_method = {r["method"]: r for r in sim.rows}
        rows += [{**compare(r, by_method[r["method"]], config.name), "is_calibration": False}
                 for r in replay.rows if r["method"] in methods]
    emit({"num_requests": args.num_requests, "utilization": args.utilization, "slo_scale": args.slo_scale,
          "table_instances": len(table.outcomes), "speed_factor": calib_run.speed_factor,
          "speed_factors": factors, "base_slo_s": bases, "paces": paces, "pace_calibration": calibration,
          "in_trace_paces": by_setting,
          "num_within": sum(r["is_within"] for r in rows), "rows": rows}, args.json, args.out_json,
         lambda: print_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
