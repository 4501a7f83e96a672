"""How well the profile a server plans with prices the batches the engine serves.

The default check (about 5-8 minutes on 2 cores): MIX prompts stored as a server stores them, then
`--batches` batches per plan family of 1-3 requests each, families interleaved so a machine's drift
reaches them alike, each timed on the serving path (staging to the first tokens) and priced by the
profile a server would plan with (`calibration.packaged.serving_profile`: the packaged one
calibrated to this machine at start, or a measured one), term by term
(`calibration.batch_check`). Target, for every family with >= 20 batches: median |relative
error| <= 5% and p90 <= 15%. The payload (`--out`) carries its commit and wall time.

`--repeats K` (K >= 5) times each batch K times in a row and prices it against the median time:
each family's signed median error is then the price's bias, apart from the machine's noise (one
timing of an identical batch moves by 7-10% here, `docs/bench/cost_floor.json`), reported beside
the family's own repeat spread. Target: |bias| <= 5% for every family.

`--full`: the long check below, on replays of whole traces.

How well the shipped profile prices the real engine: every batch of replays of three MIX traces
(Poisson, and bursty Gamma CV 2 and CV 3, at one utilization and SLO scale, trace seeds the profile
never saw), measured batch TTFT (`batch_s`: staging to the first tokens, as serving times it)
against the profile's prediction for that batch's shape, plan and final coverages, the profile
rescaled to the replay's measured speed factor exactly as serving does (`calibration.packaged`).

Methods cover the plan families (`bench.pace.family`): CacheSmith (kv_dev/1/1, qci/1/1), the four
selective presets at 15% (CacheBlend kv_dev/1/0, EPIC position/0/0, ProphetKV qci/0/1, FusionRAG
qci_last/0/1), full prefill (position/1/0) and full reuse (position/0/0). Target, for every family
with >= 20 batches: median |relative error| <= 5% and p90 <= 15%. The `paced_*` columns judge the
price the serving planner puts on a batch: the profile times the pace its `PaceBook` learned from
the replay's earlier batches (`add_paced`); the `planner` table judges the price the planner really
put on each of CacheSmith's batches, which the engine records (`planned_s`).

Replays are cached per (setting, method) under --runs (a stopped run resumes; cached runs are not
replayed). On a machine shared with other jobs, `--quiet BUSY` makes each batch wait (off the
replay clock, which is virtual) until at most that fraction of the cores is busy; a batch that
waited the longest and ran anyway is marked contended, and the table also gives the errors over
the quiet batches alone. `--machine` (with `--full`, or `--quick`: the fit needs the replays)
refits the simulator's `MachinePace` (a pace per plan family and batch class,
`bench.pace.fit_paces`: the format-2 profile prices placed rows and the batch overhead itself) on
these batches against the profile: what is left of it is the residual the profile does not
describe. `--machine-out FILE` writes that fit in the form `cachesmith report --machine` reads
(the grid's simulated machine, `docs/bench/machine.json`).

Each replay's speed factors are computed here for the profile being judged: the replay's measured
mean single-request full-prefill TTFT (its base SLO) over that profile's mean prediction for the
same instances, and the median measured / predicted of the reuse probes base.json keeps (the
reuse factor: `calibration.packaged.rescaled`; replays recorded before it take the speed factor).
So a refit profile re-prices the cached replays without running them again (the factor in
base.json belongs to the profile the replay ran with).
`--json` prints the payload; `--out FILE` writes it (per-batch rows go to <runs>/batches.json).
`--quick`: a small smoke run (12 requests a trace, three methods) under <runs>/quick.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.common.batch_errors import (MIN_BATCHES, TARGET_MEDIAN, TARGET_P90, add_paced, batch_rows, is_within,
                                           planner_summary, summary)
from benchmarks.common.payload import emit, print_table

from cachesmith.bench import BenchConfig, run_bench
from cachesmith.bench.pace import fit_paces, trace_batches
from cachesmith.bench.setting import instances
from cachesmith.jsonl import load_keyed
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchShape, CostModel, Profile
from cachesmith.calibration.packaged import find_profile, rescaled
from cachesmith.calibration.quiet import QuietRun
from cachesmith.workloads.prompts import instance_prompt

SETTINGS = (("poisson", 1.0, 21), ("gamma", 2.0, 22), ("gamma", 3.0, 23))  # (pattern, CV, trace seed)
METHODS = ("cachesmith", "cacheblend@0.15", "epic@0.15", "prophetkv@0.15", "fusionrag@0.15", "full_prefill",
           "full_reuse")
QUICK_METHODS = ("cachesmith", "epic@0.15", "full_prefill")
# with each batch timed this many times, its price is judged against the median: |bias| <= 5%
MIN_BIAS_REPEATS, TARGET_BIAS = 5, 0.05
BIAS_COLUMNS = ["bias", "repeat_spread", "is_bias_within"]
COLUMNS = ["family", "batches", "median_abs_rel_err", "p90_abs_rel_err", "median_rel_err", "quiet_batches",
           "quiet_median_abs_rel_err", "quiet_p90_abs_rel_err", "is_within", "paced_median_abs_rel_err",
           "paced_p90_abs_rel_err", "is_paced_within"]


def token_counts(pipe: RagPipeline, config: BenchConfig) -> dict[int, tuple[int, int, int]]:
    """(context, suffix, prefix) tokens of each request id's prompt."""
    out = {}
    for rid, inst in enumerate(instances(config)):
        if isinstance(inst, str):
            continue
        parts = instance_prompt(pipe, inst)
        out[rid] = (sum(len(c) for c in parts.chunk_ids), len(parts.suffix_ids), len(parts.prefix_ids))
    return out


def replay_factor(tokens: dict[int, tuple[int, int, int]], config: BenchConfig, base_slo_s: float,
                  profile: Profile) -> float:
    """Measured/predicted full-prefill TTFT of a replay for `profile`: its base SLO (the mean of the
    single-request full prefills it measured, on its first `num_base_samples` instances, whose
    token counts `tokens` holds in request order) over the profile's mean prediction for them.
    The mean, not run_bench's median of ratios: base.json keeps only the mean."""
    cost = CostModel(profile)
    sample = [tokens[rid] for rid in sorted(tokens)][: config.num_base_samples]
    return base_slo_s / float(np.mean([cost.full_prefill_ttft(BatchShape((c,), (q,), (p,))) for c, q, p in sample]))


def machine_payload(batches: list, profile: Profile, source: str, factors: list[float], num_replays: int) -> dict:
    """The simulator's machine fit on these batches (`bench.pace.fit_paces`), in
    `docs/bench/machine.json`'s form."""
    machine, rows = fit_paces(batches, profile.num_layers)
    name = f"{source} {profile.model_name}-{profile.dtype}-{profile.device}"
    return {"profile": name, "speed_factor": float(np.median(factors)), "num_replays": num_replays,
            "num_batches": len(batches), "machine": machine.to_dict(), "rows": rows,
            "source": "benchmarks/cost_model.py replays"}


class QuietLog:
    """`pipe.batch_guard`: each timed prefill waits for a quiet machine first (`--quiet`) and notes
    the wait and the other processes' share of the cores during it; `take(n)` hands out the last n
    notes (the batches of the run just made: the base SLO's single prefills come first)."""

    def __init__(self, max_busy: float | None, max_wait_s: float) -> None:
        self.max_busy, self.max_wait_s, self.notes = max_busy, max_wait_s, []

    @contextlib.contextmanager
    def __call__(self):
        if self.max_busy is None:
            yield
            return
        with QuietRun(self.max_busy, self.max_wait_s) as quiet:
            yield
        self.notes.append(quiet.record())

    def take(self, n: int) -> list[dict]:
        out, self.notes = self.notes[-n:] if n else [], []
        return out


def per_request_s(pipe: RagPipeline, cost: CostModel, method: str) -> float:
    """Rough wall time per request of a replay of `method`: its single-request TTFT at a mean MIX
    prompt, plus greedy decoding."""
    from cachesmith.methods import parse_method

    L, shape = pipe.model.num_layers, BatchShape((1700,), (32,), (25,))
    meth = parse_method(method)
    if meth.preset is None:  # CacheSmith: about a (kv_dev, 1, 1, 30%) plan
        return float(cost.ttft(shape, "kv_dev", 1, 1, np.array([0.3]))[0]) + 0.3
    plan = meth.plan(L)
    return float(cost.ttft(shape, plan.signal.value, plan.warmup, plan.probe, np.array([plan.coverage]))[0]) + 0.3


def run_path(runs_dir: Path, config: BenchConfig) -> Path:
    """Where `run_bench` keeps the run of a one-method config."""
    scale = config.slo_scales[0]
    return runs_dir / config.name / "runs" / f"{config.digest()}-{config.methods[0].replace('@', '_')}-x{scale:g}.json"


FAST_PLANS = (("cacheblend@0.15",), ("epic@0.15", "full_reuse"), ("full_prefill",), ("prophetkv@0.15",),
              ("fusionrag@0.15",), ("kv_dev", 1, 1, (0.1, 0.3, 0.5)))  # a family's plans, served in turn
FAST_SIZES = (1, 2, 3)  # requests a batch, in turn (replayed batches were mostly one request)
FAST_COLUMNS = ["family", "batches", "median_abs_rel_err", "p90_abs_rel_err", "median_rel_err", "worst_term",
                "worst_term_share", "is_within", "paced_median_abs_rel_err", "paced_p90_abs_rel_err", "is_paced_within"]


def fast_plans(num_layers: int, index: int) -> list:
    """One plan of each family for the `index`-th round."""
    from cachesmith.methods import parse_method
    from cachesmith.recompute import RecomputeConfig

    plans = []
    for entry in FAST_PLANS:
        if len(entry) == 4:
            signal, w, p, coverages = entry
            plans.append(RecomputeConfig(signal, w, p, coverages[index % len(coverages)]))
        else:
            plans.append(parse_method(entry[index % len(entry)]).plan(num_layers))
    return plans


def fast_main(args) -> None:
    """The default check: batches timed now on the serving path, priced by the serving profile."""
    import random
    import time

    from tqdm import tqdm

    from cachesmith.calibration.batch_check import check_repeated, repeat_spread, summary as term_summary
    from cachesmith.calibration.packaged import serving_profile

    began = time.perf_counter()
    pipe = RagPipeline()
    profile, source = serving_profile(pipe)
    print(f"profile: {source}", file=sys.stderr, flush=True)
    config = BenchConfig("mix", None, None, args.num_prompts, "poisson", 1.0, 1.0, (2.0,), ("cachesmith",),
                         "task", args.seed)
    prompts = [pipe.stored_prompt(instance_prompt(pipe, inst))
               for inst in tqdm(instances(config), desc="store prompts", unit="prompt")]
    rng, cost, checked, times = random.Random(args.seed), CostModel(profile), [], []
    desc = f"timed batches (a batch per family each, {args.repeats} run(s) a batch)"
    for i in tqdm(range(args.batches), desc=desc, unit="round"):
        size = FAST_SIZES[i % len(FAST_SIZES)]
        for plan in fast_plans(pipe.model.num_layers, i):
            median_run, runs = check_repeated(pipe, cost, rng.sample(prompts, size), plan, args.repeats)
            checked.append(median_run)
            times.append(runs)
    paced = paced_errors([b.to_dict() for b in checked])  # one pace book, in the order they ran
    families = term_summary(checked, MIN_BATCHES, paced)
    for row in families:
        row["is_within"] = is_within(row, row["batches"])
        row["is_paced_within"] = is_within(row, row["batches"], "paced_")
        if args.repeats >= MIN_BIAS_REPEATS:  # each batch at its median time: the signed median is the bias
            row["bias"] = row["median_rel_err"]
            row["repeat_spread"] = repeat_spread([t for b, t in zip(checked, times) if b.family == row["family"]])
            row["is_bias_within"] = abs(row["bias"]) <= TARGET_BIAS
    payload = {"check": "batches timed on the serving path", "profile_source": source,
               "num_prompts": args.num_prompts, "batches_per_family": args.batches, "repeats": args.repeats,
               "families": families,
               "batches": [{**b.to_dict(), "paced_rel_err": e} for b, e in zip(checked, paced)],
               "wall_s": time.perf_counter() - began,
               "targets": {"min_batches": MIN_BATCHES, "median_abs_rel_err": TARGET_MEDIAN,
                           "p90_abs_rel_err": TARGET_P90, "abs_bias": TARGET_BIAS}}
    columns = FAST_COLUMNS + (BIAS_COLUMNS if args.repeats >= MIN_BIAS_REPEATS else [])
    emit(payload, args.json, args.out, lambda: (
        print_table(families, columns),
        print(f"{len(checked)} batches in {payload['wall_s'] / 60:.1f} min")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the long check on replays of whole traces (hours)")
    ap.add_argument("--batches", type=int, default=20, help="batches per plan family (default check)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each batch (default check); from 5, each is priced against its median time "
                         "and the table gives each family's bias and repeat spread")
    ap.add_argument("--num-prompts", type=int, default=24, help="MIX prompts the batches draw from (default check)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=56)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--runs", type=Path, default=Path("docs/bench/cost_model"), help="replay runs (cached)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 requests a trace, three methods")
    ap.add_argument("--quiet", type=float, default=None, metavar="BUSY",
                    help="each batch first waits until at most this fraction of the cores is busy (shared machine)")
    ap.add_argument("--max-wait", type=float, default=600.0, help="longest quiet wait per batch, seconds")
    ap.add_argument("--machine", action="store_true",
                    help="with --full: refit the simulator's MachinePace on the replays' batches")
    ap.add_argument("--machine-out", type=Path, default=None,
                    help="with --machine: write the fit where `cachesmith report --machine` reads it")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON payload here")
    args = ap.parse_args()
    if args.machine_out is not None and not args.machine:
        ap.error("--machine-out writes the fit of --machine: add --machine")
    if args.machine and not (args.full or args.quick):
        ap.error("--machine needs --full: the refit fits the batches of trace replays, which the default "
                 "check does not run (--quick: a small smoke run of them)")
    if not (args.full or args.quick):
        fast_main(args)
        return

    methods = QUICK_METHODS if args.quick else tuple(args.methods.split(","))
    num_requests = 12 if args.quick else args.num_requests
    runs_dir = args.runs / "quick" if args.quick else args.runs
    pipe = RagPipeline()
    log = QuietLog(args.quiet, args.max_wait)
    pipe.batch_guard = log
    packaged, source = find_profile(pipe)
    print(f"profile: {source}" + (" (rescaled to each replay's speed factor)" if source == "packaged" else ""),
          file=sys.stderr, flush=True)

    configs = [BenchConfig("mix", None, None, num_requests, pattern, args.utilization, cv, (args.slo_scale,),
                           (m,), "task", seed) for pattern, cv, seed in SETTINGS for m in methods]
    cost = CostModel(packaged)
    left = [c for c in configs if not run_path(runs_dir, c).exists()]
    est = sum(num_requests * per_request_s(pipe, cost, c.methods[0]) for c in left)
    est += sum(9 * cost.full_prefill_ttft(BatchShape((1700,), (32,), (25,)))
               for c in configs if c.methods[0] == methods[0] and not (runs_dir / c.name / "base.json").exists())
    print(f"{len(configs)} replays ({len(left)} not cached): about {est / 60:.0f} min on the shipped profile, "
          f"plus waits for a quiet machine", file=sys.stderr, flush=True)

    rows, settings, machine_batches = [], [], []
    for config in configs:
        out = runs_dir / config.name
        waits_path = out / "quiet.jsonl"
        log.take(0)
        was_cached = run_path(runs_dir, config).exists()
        result = run_bench(pipe, config, out, show_progress=not args.json)
        method = config.methods[0]
        records = [r for r in result.records if r["method"] == method]
        done = load_keyed(waits_path)
        num_batches = len({r["batch_id"] for r in records if r["error"] is None})
        fresh = log.take(num_batches)
        if not was_cached and len(fresh) == num_batches and num_batches:
            with waits_path.open("a", encoding="utf-8") as f:
                for i, w in enumerate(fresh):
                    done[f"{method}/{i}"] = {"key": f"{method}/{i}", **w}
                    f.write(json.dumps(done[f"{method}/{i}"]) + "\n")
        tokens = token_counts(pipe, config)
        factor = replay_factor(tokens, config, result.base_slo_s, packaged)
        reuse = result.reuse_factor or factor  # None: replayed before the reuse probes, one factor
        profile = rescaled(packaged, factor, reuse) if result.profile_source == "packaged" else packaged
        rows += batch_rows(records, tokens, CostModel(profile), config.name, done)
        if method == methods[0]:
            settings.append({"setting": config.name, "speed_factor": factor, "reuse_factor": reuse,
                             "base_slo_s": result.base_slo_s, "profile_source": result.profile_source})
        if args.machine:
            counts = [SimpleNamespace(context_tokens=c, suffix_tokens=q, prefix_tokens=p)
                      for c, q, p in (tokens[i] for i in range(max(tokens) + 1))]
            machine_batches += trace_batches(records, counts, profile)

    rows = add_paced(rows)
    families, by_method = summary(rows, "family"), summary(rows, "method")
    payload = {"families": families, "methods": by_method, "planner": planner_summary(rows), "settings": settings,
               "num_requests": num_requests,
               "utilization": args.utilization, "slo_scale": args.slo_scale, "profile_source": source,
               "num_batches": len(rows), "num_contended": sum(not r["is_quiet"] for r in rows),
               "targets": {"min_batches": MIN_BATCHES, "median_abs_rel_err": TARGET_MEDIAN,
                           "p90_abs_rel_err": TARGET_P90}}
    if args.machine and machine_batches:
        fit = machine_payload(machine_batches, packaged, source, [s["speed_factor"] for s in settings],
                              len(configs))
        payload["machine"] = {**fit["machine"], "residuals": fit["rows"]}
        if args.machine_out is not None:
            Path(args.machine_out).write_text(json.dumps(fit, indent=1), encoding="utf-8")
    (runs_dir / "batches.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")

    def table() -> None:
        print_table(families, COLUMNS)
        print()
        print_table(by_method, ["method"] + COLUMNS[1:])
        if payload["planner"]:
            print("\nThe planner's own (paced) price of its batches:")
            print_table(payload["planner"], ["family", "batches", "median_abs_rel_err", "p90_abs_rel_err",
                                             "median_rel_err", "replanned_batches", "is_within"])
        if "machine" in payload:
            m = payload["machine"]
            paces = json.dumps({k: round(v, 3) for k, v in m["paces"].items()})
            print(f"\nMachinePace on the new profile: paces {paces}, "
                  f"reuse_per_row {m['reuse_per_row']:.3f}, per_batch {m['per_batch']:.3f}")

    emit(payload, args.json, args.out, table)


if __name__ == "__main__":
    main()
