"""Validate the simulator against the replay clock: the same MIX traces served by the
real engine on the replay clock and by the simulator (cost-model time, outcome-table verdicts).

The default check takes about 10 minutes on 2 cores: traces of `--num-requests` 16, one seed per
setting, one calibration trace, no second replay for the noise floor. `--full` is the long check
described below (96 requests, three seeds, two calibration traces, the noise replay: hours). Every
payload carries its commit and wall time.

Settings: one Poisson and two bursty (Gamma CV 2 and 3) traces at the same utilization, each
replayed on traces of three seeds (--seeds) with CacheSmith and a static baseline. Both sides share
the instances (the table's measured ones, written as a workload file whose lines the requests
cycle through) and the base SLO; the simulator plans with the profile the replay planned with
(the packaged one at the replay's measured speed factor). Its machine (`bench.pace.MachinePace`)
runs each plan family at this machine's pace plus a reuse cost per cached row a Patch pass places,
both fit to the batches of replays of traces of their own (Gamma CV 2.5, seeds 1 and 2); families
those never ran take the pace of single requests measured here, scaled to the traces' level. The
paces are measured / priced at each replay's own speed factors (measured at its start, as a server
measures them), and the simulator applies them at the speed of the replay it is compared with: the
machine's speed moved by 5-30% between replays, and paces carried from one replay to another would carry it.
Every validation trace is held out. The replay runs are cached under --out (a stopped run resumes).

Bars, on each setting's means over its seeds: |QSA difference| <= 3 points and P99 TTFT within
10%. One run is noisy: a burst's batching turns on tens of milliseconds and this shared machine
drifts by 10-20% between replays. The per-seed rows show by how much, and one trace is replayed
twice (NOISE) to measure the replay's own noise under the same bars. Cross-validated rows: each
setting against a machine fit to the calibration replays and the other two settings' replays
(leave one setting out), which averages the drift over all the hours the replays took. Rows: setting, seeds,
method, qsa_replay, qsa_sim, p99_replay_s, p99_sim_s, their gaps, and attainment and gate rate of
both. `--json` prints the payload; `--out-json FILE` writes it.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common.payload import emit, print_table

from cachesmith.model.assets import cachesmith_home
from cachesmith.bench import BenchConfig, run_bench
from cachesmith.bench.pace import fit_machine, measure_paces, residuals, trace_batches
from cachesmith.pipeline import RagPipeline
from cachesmith.workloads.tasks import generate
from cachesmith.planner import Profile
from cachesmith.calibration.packaged import find_profile, rescaled
from cachesmith.bench.outcomes import OutcomeTable, default_table_path
from cachesmith.bench.simulate import simulate

SETTINGS = (("poisson", 1.0), ("gamma", 2.0), ("gamma", 3.0))
SEEDS = "0,1,2"  # each setting is replayed on traces of these seeds; the bars hold for their means
CALIBRATION = (("gamma", 2.5, 1), ("gamma", 2.5, 2))  # (pattern, CV, seed): traces of their own
COMMITTED_TABLES = Path(__file__).resolve().parent.parent / "docs" / "results"
NOISE = (("gamma", 2.0, 0),)  # traces replayed a second time: the replay's own noise floor
COLUMNS = ["setting", "seeds", "method", "qsa_replay", "qsa_sim", "qsa_diff_pts", "p99_replay_s", "p99_sim_s",
           "p99_rel_err", "att_replay", "att_sim", "gate_replay", "gate_sim", "is_within"]


def compare(replays: list[dict], sims: list[dict], setting: str) -> dict:
    """One method on one setting: replay and simulator rows (one per seed), compared on their means."""
    def mean(rows, key):
        return statistics.fmean(r[key] for r in rows)

    qsa_r, qsa_s, p99_r, p99_s = mean(replays, "qsa"), mean(sims, "qsa"), mean(replays, "ttft_p99_s"), mean(sims, "ttft_p99_s")
    diff, rel = 100 * (qsa_s - qsa_r), p99_s / p99_r - 1
    return {"setting": setting, "method": replays[0]["method"], "qsa_replay": qsa_r, "qsa_sim": qsa_s,
            "qsa_diff_pts": diff, "p99_replay_s": p99_r, "p99_sim_s": p99_s, "p99_rel_err": rel,
            "att_replay": mean(replays, "ttft_attainment"), "att_sim": mean(sims, "ttft_attainment"),
            "gate_replay": mean(replays, "gate_rate"), "gate_sim": mean(sims, "gate_rate"),
            "is_within": abs(diff) <= 3.0 and abs(rel) <= 0.10}


def table_path(pipe: RagPipeline) -> Path:
    """The table `cachesmith outcomes` measured here, else the one committed beside the results."""
    measured = default_table_path(pipe)
    if measured.exists():
        return measured
    committed = COMMITTED_TABLES / f"outcomes-{measured.name}"
    print(f"no measured outcome table at {measured}: using the committed {committed}", file=sys.stderr, flush=True)
    return committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the long check: 96 requests, three seeds, the noise replay")
    ap.add_argument("--num-requests", type=int, default=None, help="requests a trace (default 16; --full 96)")
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--methods", default="cachesmith,cacheblend@0.15")
    ap.add_argument("--seeds", default=None, help="trace seeds per setting (comma-separated; default 0, --full 0,1,2)")
    ap.add_argument("--table", type=Path, default=None,
                    help="outcome table (default: the measured one, else the committed docs/results one)")
    ap.add_argument("--out", type=Path, default=cachesmith_home() / "sim_validation", help="replay runs (cached)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args()
    began = time.perf_counter()
    args.num_requests = args.num_requests or (96 if args.full else 16)
    args.seeds = args.seeds or (SEEDS if args.full else "0")
    calibration_traces, noise_traces = (CALIBRATION, NOISE) if args.full else (CALIBRATION[:1], ())

    pipe = RagPipeline()
    table = OutcomeTable.load(args.table or table_path(pipe))
    methods = tuple(args.methods.split(","))
    workload = args.out / "measured-instances.jsonl"
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text("".join(generate("mix", o.seed).to_json() + "\n" for o in table.outcomes), encoding="utf-8")

    def config_of(pattern: str, cv: float, seed: int = 0) -> BenchConfig:
        return BenchConfig("file", None, str(workload), args.num_requests, pattern, args.utilization, cv,
                           (args.slo_scale,), methods, "task", seed)

    # calibrate the simulator's machine on traces of their own: each plan family's pace, single and
    # in batches of several, and the reuse time per placed row (other families: single requests timed here)
    calib_runs = [run_bench(pipe, c, args.out / c.name) for c in (config_of(*x) for x in calibration_traces)]
    packaged, source = find_profile(pipe)
    print(f"profile: {source}" + (" (rescaled to each replay's speed factor)" if source == "packaged" else ""),
          file=sys.stderr, flush=True)

    def profile_of(run) -> Profile:
        """The profile the replay's engine planned with: the packaged one at the run's speed factors."""
        return rescaled(packaged, run.speed_factor, run.reuse_factor) if source == "packaged" else packaged

    # the machine's paces are measured / priced by the profile at each replay's own measured speed, so
    # they hold what the speed factors leave out, not the drift between replays (which the factors,
    # measured at each replay's start as a server measures them, already price)
    reference = profile_of(calib_runs[0])
    isolated = measure_paces(pipe, reference, [generate("mix", o.seed) for o in table.outcomes[:4]],
                             args.out / "paces.json")
    calib_batches = [b for run in calib_runs for b in trace_batches(run.records, table.outcomes, profile_of(run))]
    machine = fit_machine(calib_batches, isolated)
    calibration = {"settings": [r.config.name for r in calib_runs], "isolated": isolated,
                   "residuals": residuals(calib_batches, machine)}
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = {(pattern, cv): [run_bench(pipe, c, args.out / c.name) for c in (config_of(pattern, cv, s) for s in seeds)]
            for pattern, cv in SETTINGS}
    batches = {k: [trace_batches(r.records, table.outcomes, profile_of(r)) for r in rs] for k, rs in runs.items()}

    def against(setting, fitted) -> tuple[list[dict], list[dict]]:
        """(per-seed rows, mean rows) of one setting's replays against the simulator on `fitted`;
        the simulator plans with each replay's profile, as the replay's engine did, and its machine
        runs at that replay's measured speed."""
        sims = [{r["method"]: r for r in simulate(table, profile_of(run), run.config, run.base_slo_s,
                                                  pool=table.outcomes, machine=fitted,
                                                  machine_profile=profile_of(run)).rows} for run in runs[setting]]
        replays = [{r["method"]: r for r in run.rows} for run in runs[setting]]
        name = runs[setting][0].config.name.rsplit("-s", 1)[0]
        per = [{**compare([rp[m]], [sm[m]], run.config.name), "seeds": str(run.config.seed)}
               for run, rp, sm in zip(runs[setting], replays, sims) for m in methods]
        return per, [{**compare([r[m] for r in replays], [s_[m] for s_ in sims], name), "seeds": args.seeds}
                     for m in methods]

    rows, per_seed, cross = [], [], []
    for setting in runs:
        per, mean = against(setting, machine)
        per_seed, rows = per_seed + per, rows + mean
        # leave this setting out, fit on the calibration and the other settings' replays: drift over
        # the hours the replays took is averaged in, and this setting is still never seen
        others = [b for k, bs in batches.items() if k != setting for run_batches in bs for b in run_batches]
        cross += against(setting, fit_machine(calib_batches + others, isolated))[1]
    # what the simulator misses: measured / simulated time of each replay's batches
    by_setting = {r.config.name: residuals(b, machine) for k in runs for r, b in zip(runs[k], batches[k])}
    factors = [r.speed_factor for rs in runs.values() for r in rs]
    bases = [r.base_slo_s for rs in runs.values() for r in rs]
    noise = []  # the same trace replayed twice, compared with the same bars
    for pattern, cv, seed in noise_traces:
        config = config_of(pattern, cv, seed)
        first = run_bench(pipe, config, args.out / config.name)
        again_dir = args.out / (config.name + "-again")
        again_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(args.out / config.name / "base.json", again_dir / "base.json")  # the same trace: same base
        again = run_bench(pipe, config, again_dir)
        noise += [{**compare([first.rows[i]], [again.rows[i]], config.name + " (replay again)"), "seeds": str(seed)}
                  for i, r in enumerate(first.rows) if r["method"] in methods]
    emit({"num_requests": args.num_requests, "utilization": args.utilization, "slo_scale": args.slo_scale,
          "seeds": seeds, "table_instances": len(table.outcomes), "speed_factor": calib_runs[0].speed_factor,
          "speed_factors": factors, "base_slo_s": bases, "machine": machine.to_dict(),
          "pace_calibration": calibration, "residuals": by_setting,
          "num_within": sum(r["is_within"] for r in rows), "rows": rows, "per_seed": per_seed,
          "cross_validated": cross, "num_within_cross": sum(r["is_within"] for r in cross), "replay_noise": noise,
          "mode": "full" if args.full else "default", "wall_s": time.perf_counter() - began},
         args.json, args.out_json, lambda: print_table(per_seed + rows + cross + noise, COLUMNS))


if __name__ == "__main__":
    main()
