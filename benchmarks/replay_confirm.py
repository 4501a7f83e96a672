"""Confirm the simulated grid on the real model: MIX traces replayed through the real
engine on the replay clock, CacheSmith against Full Prefill, Full Reuse and the four presets at 15%.

Settings: Poisson at utilization 0.7, Gamma CV 2 and Gamma CV 3 (the same utilization), SLO 2x the
measured base, two trace seeds each. The default seeds (3, 4) draw instances (seed x 100003 + i)
disjoint from the outcome table's and from the packaged demand profile's, so the planner has seen
none of them. Each (setting, seed) is one `cachesmith bench` run cached under --out: a stopped
benchmark resumes at the first run not yet saved. A newcomer needs nothing else: the packaged
profile is used (rescaled to this machine's measured speed) unless `cachesmith profile` wrote one.

Rows: {setting, seed, method, qsa, gate_rate, ttft_attainment}; the summary per setting gives each
method's mean QSA over the seeds, the best static method and CacheSmith's lead over it in points
(target: >= +5). `--json` prints the payload; `--out-json FILE` writes it. Timing matters here: run
it on a quiet machine (it takes hours on 2 cores). `--pool A.json B.json ...` runs nothing: it
summarizes the rows of earlier payloads together (more seeds than one run replays), counting a
method in a setting only where every seed of that setting has it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.common.payload import emit, print_table

from cachesmith.model.assets import cachesmith_home
from cachesmith.bench import BenchConfig, run_bench
from cachesmith.pipeline import RagPipeline

SETTINGS = (("poisson", 1.0), ("gamma", 2.0), ("gamma", 3.0))
METHODS = ("cachesmith", "full_prefill", "full_reuse", "cacheblend@0.15", "epic@0.15", "prophetkv@0.15",
           "fusionrag@0.15")
STATIC = tuple(m for m in METHODS if not m.startswith("cachesmith"))
COLUMNS = ["setting", "seed", "method", "qsa", "gate_rate", "ttft_attainment"]
SUMMARY = ["setting", "seeds", "cachesmith", "best_static", "best_static_qsa", "lead_pts", "is_target_met"]


def setting_name(pattern: str, cv: float, utilization: float) -> str:
    return f"poisson-u{utilization:g}" if pattern == "poisson" else f"gamma-cv{cv:g}-u{utilization:g}"


def summarize_setting(rows: list[dict], name: str) -> dict:
    """Mean QSA over the seeds per method; CacheSmith's lead over the best static method."""
    mine = [r for r in rows if r["setting"] == name]
    means = {m: statistics.fmean(r["qsa"] for r in mine if r["method"] == m)
             for m in {r["method"] for r in mine}}
    best = max((m for m in means if m in STATIC), key=means.get)
    lead = 100 * (means["cachesmith"] - means[best])
    return {"setting": name, "seeds": ",".join(sorted({str(r["seed"]) for r in mine})),
            "cachesmith": means["cachesmith"], "best_static": best, "best_static_qsa": means[best],
            "lead_pts": lead, "is_target_met": lead >= 5.0, "means": means}


POOLED_KEYS = ("num_requests", "utilization", "slo_scale")


def pooled_rows(paths: list[Path]) -> tuple[list[dict], dict]:
    """(rows, what every payload shares) of earlier payloads: one row per (setting, seed, method)
    (a later file's wins), less the methods some seed of their setting lacks, so every mean is over
    the same traces. Payloads of different request counts, utilizations or SLO scales are refused."""
    rows, shared = {}, None
    for path in paths:
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            mine = {k: payload[k] for k in POOLED_KEYS}
            keyed = {(r["setting"], r["seed"], r["method"]): r for r in payload["rows"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--pool: {path} is not a replay_confirm payload ({type(exc).__name__}: {exc})") from None
        if shared not in (None, mine):
            raise SystemExit(f"--pool: {path} was run with {mine}, the others with {shared}")
        shared = mine
        rows.update(keyed)
    seeds: dict[str, set] = {}
    for setting, seed, _ in rows:
        seeds.setdefault(setting, set()).add(seed)
    everywhere = {(setting, m) for setting, _, m in rows
                  if all((setting, s, m) in rows for s in seeds[setting])}
    return [r for key, r in rows.items() if (key[0], key[2]) in everywhere], shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="3,4", help="trace seeds per setting (comma-separated)")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--settings", default=None,
                    help="only these settings, e.g. 'poisson-u0.7,gamma-cv3-u0.7' (default: all three)")
    ap.add_argument("--out", type=Path, default=cachesmith_home() / "replay_confirm", help="replay runs (cached)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--pool", type=Path, nargs="+", default=None, help="summarize these payloads together")
    args = ap.parse_args()
    if args.pool:
        rows, shared = pooled_rows(args.pool)
        for name in dict.fromkeys(r["setting"] for r in rows):
            have = {r["method"] for r in rows if r["setting"] == name}
            if "cachesmith" not in have or not have & set(STATIC):
                ap.error(f"--pool: {name} needs cachesmith and a static method on every one of its seeds")
        return report(rows, tuple(dict.fromkeys(r["method"] for r in rows)), shared, args)

    methods = tuple(args.methods.split(","))
    if "cachesmith" not in methods or not set(methods) & set(STATIC):
        ap.error("--methods needs cachesmith and at least one static method")
    chosen = set(args.settings.split(",")) if args.settings else None
    pipe = RagPipeline()
    rows = []
    for pattern, cv in SETTINGS:
        name = setting_name(pattern, cv, args.utilization)
        if chosen is not None and name not in chosen:
            continue
        for seed in (int(s) for s in args.seeds.split(",")):
            config = BenchConfig("mix", None, None, args.num_requests, pattern, args.utilization, cv,
                                 (args.slo_scale,), methods, "task", seed)
            print(f"{name} seed {seed}: {len(methods)} methods", file=sys.stderr, flush=True)
            result = run_bench(pipe, config, args.out / config.name)
            rows += [{"setting": name, "seed": seed, "method": r["method"], "qsa": r["qsa"],
                      "gate_rate": r["gate_rate"], "ttft_attainment": r["ttft_attainment"]}
                     for r in result.rows if r["method"] in methods]
    if not rows:
        ap.error(f"--settings {args.settings}: none of {', '.join(setting_name(p, c, args.utilization) for p, c in SETTINGS)}")
    report(rows, methods, {k: getattr(args, k) for k in POOLED_KEYS}, args)


def report(rows: list[dict], methods: tuple[str, ...], run: dict, args: argparse.Namespace) -> None:
    """Print or write the payload: `run` holds the trace parameters (POOLED_KEYS) the rows share."""
    summary = [summarize_setting(rows, name) for name in dict.fromkeys(r["setting"] for r in rows)]
    emit({**run, "methods": list(methods), "rows": rows, "summary": summary,
          "num_target_met": sum(s["is_target_met"] for s in summary)},
         args.json, args.out_json, lambda: (print_table(rows, COLUMNS), print(), print_table(summary, SUMMARY)))


if __name__ == "__main__":
    main()
