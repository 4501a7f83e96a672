"""Validate the simulator against the replay clock (issue #8): the same MIX traces served by the
real engine on the replay clock and by the simulator (cost-model time, outcome-table verdicts).

Settings: one Poisson and two bursty (Gamma CV 2 and 3) traces at the same utilization, each with
CacheSmith and a static baseline. Both sides share the instances (the table's measured ones,
written as a workload file whose lines the requests cycle through), the base SLO and the profile
(rescaled by the speed factor the replay bench measured). The simulator's machine runs each plan
family at this machine's pace (`bench.pace`): measured/predicted TTFT of the batches of the first
(Poisson) replay where a method ran that family, else the pace of single requests measured here
scaled to the trace's level. The Poisson rows are therefore in-sample for time; the two bursty
settings are held out. The replay runs
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
    rows, factors, bases, paces, by_setting = [], [], [], None, {}
    for pattern, cv in SETTINGS:
        config = BenchConfig("file", None, str(workload), args.num_requests, pattern, args.utilization, cv,
                             (args.slo_scale,), methods, "task", 0)
        replay = run_bench(pipe, config, args.out / config.name)
        factors.append(replay.speed_factor)
        bases.append(replay.base_slo_s)
        if paces is None:  # calibrated on the first (Poisson) setting only; the bursty two are held out
            profile, source = find_profile(pipe)
            if source == "packaged":
                profile = rescaled(profile, replay.speed_factor)
            calib = [generate("mix", o.seed) for o in table.outcomes[:4]]  # one instance of each task
            isolated = measure_paces(pipe, profile, calib, args.out / "paces.json")
            in_trace = trace_paces(replay.records, table.outcomes, profile)
            paces = combine_paces(isolated, in_trace)
            calibration = {"setting": config.name, "isolated": isolated,
                           "in_trace": {k: statistics.median(v) for k, v in in_trace.items()}}
        sim = simulate(table, profile, config, replay.base_slo_s, pool=table.outcomes, paces=paces)
        by_size = trace_paces(replay.records, table.outcomes, profile, is_by_size=True)  # what the sim misses
        by_setting[config.name] = {k: {"median": statistics.median(v), "num_batches": len(v)} for k, v in by_size.items()}
        by_method = {r["method"]: r for r in sim.rows}
        rows += [{**compare(r, by_method[r["method"]], config.name), "is_calibration": config.name == calibration["setting"]}
                 for r in replay.rows if r["method"] in methods]
    emit({"num_requests": args.num_requests, "utilization": args.utilization, "slo_scale": args.slo_scale,
          "table_instances": len(table.outcomes), "speed_factor": factors[0],
          "speed_factors": factors, "base_slo_s": bases, "paces": paces, "pace_calibration": calibration,
          "in_trace_paces": by_setting,
          "num_within": sum(r["is_within"] for r in rows), "rows": rows}, args.json, args.out_json,
         lambda: print_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
