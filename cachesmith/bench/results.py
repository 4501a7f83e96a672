"""Results of the simulated evaluation (paper §6.2–§6.3): BestStatic, wins, ablation tables and the
markdown report `cachesmith report` writes (docs/results.md).

In: the grid's rows (`bench.grid`), the outcome table, the simulator validation payload. Out:
markdown text (figures are drawn by `bench.figures`). BestStatic follows the paper: per arrival
pattern and SLO scale, the one static configuration with the highest QSA averaged over the four
tasks (the task is withheld; SLO, arrivals and outcomes are granted); MIX gets the same one.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from cachesmith.bench.outcomes import OutcomeTable
from cachesmith.methods import parse_method
from cachesmith.recompute import preset

FOUR_TASKS = ("pr", "msq", "vt", "mv")
TASK_NAMES = {"pr": "PR", "msq": "MSQ", "vt": "VT", "mv": "MV", "mix": "MIX", "pr+vt": "PR+VT"}
FIXED_SIGNALS = ("cachesmith:kv_dev", "cachesmith:qci")  # the ablations the default must not trail


def arrival(row: dict) -> str:
    if row["pattern"] == "poisson":
        return f"Poisson u{row['utilization']:g}"
    return f"Gamma CV{row['cv']:g}"


def settings(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(task, arrival, SLO scale) -> {method: row} of the grid study."""
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r["study"] == "grid":
            out[(r["task"], arrival(r), r["slo_scale"])][r["method"]] = r
    return out


def best_static_configs(rows: list[dict]) -> dict[tuple, str]:
    """(arrival, SLO scale) -> the static method with the best QSA averaged over the four tasks."""
    by = settings(rows)
    out = {}
    for arr, scale in sorted({(a, s) for _, a, s in by}):
        means = defaultdict(list)
        for task in FOUR_TASKS:
            for m, r in by.get((task, arr, scale), {}).items():
                if parse_method(m).is_static:
                    means[m].append(r["qsa"])
        full = {m: statistics.fmean(v) for m, v in means.items() if len(v) == len(FOUR_TASKS)}
        if full:
            out[(arr, scale)] = max(full, key=full.get)
    return out


def comparisons(rows: list[dict], method: str = "cachesmith") -> list[dict]:
    """Per grid setting: `method` (under the key "cachesmith"; default CacheSmith, or one of its
    variants), BestStatic (its config), Full Prefill and the static band."""
    best = best_static_configs(rows)
    out = []
    for (task, arr, scale), methods in settings(rows).items():
        if method not in methods or (arr, scale) not in best:
            continue
        static = [r["qsa"] for m, r in methods.items() if parse_method(m).is_static]
        config = best[(arr, scale)]
        out.append({"task": task, "arrival": arr, "slo_scale": scale, "cachesmith": methods[method]["qsa"],
                    "best_static": methods[config]["qsa"], "best_static_config": config,
                    "full_prefill": methods["full_prefill"]["qsa"], "band_min": min(static), "band_max": max(static)})
    return out


def variant_lines(rows: list[dict]) -> list[list[str]]:
    """Per CacheSmith variant in the grid: wins over BestStatic and at-or-above Full Prefill on the
    four tasks' 96 settings, the fewest wins of one task, and the most it trails the better of the
    two fixed-signal variants in one setting (points), and its mean QSA over those settings."""
    by = settings(rows)
    variants = sorted({m for ms in by.values() for m in ms if m.startswith("cachesmith")})
    lines = []
    for v in variants:
        four = [c for c in comparisons(rows, v) if c["task"] in FOUR_TASKS]
        wins = win_summary(four, "best_static")
        at_fp = sum(c["cachesmith"] >= c["full_prefill"] - 1e-9 for c in four)
        per_task = {t: sum(c["cachesmith"] > c["best_static"] + 1e-9 for c in four if c["task"] == t) for t in FOUR_TASKS}
        trails = [fixed_signal_trail({m: r["qsa"] for m, r in ms.items()}, v)
                  for (task, _, _), ms in by.items() if task in FOUR_TASKS and {v, *FIXED_SIGNALS} <= set(ms)]
        lines.append([f"`{v}`", f"{wins['num_wins']}/{wins['num_settings']}", f"{at_fp}/{len(four)}",
                      ", ".join(f"{TASK_NAMES[t]} {n}" for t, n in per_task.items()),
                      f"{100 * max(trails):+.1f}" if trails else "-",
                      f"{100 * statistics.mean(c['cachesmith'] for c in four):.1f}%" if four else "-"])
    return lines


def fixed_signal_trail(qsa: dict[str, float], variant: str = "cachesmith") -> float:
    """How far `variant`'s QSA (a fraction) trails the better fixed-signal ablation; negative: leads."""
    return max(qsa[f] for f in FIXED_SIGNALS) - qsa[variant]


def win_summary(comps: list[dict], against: str) -> dict:
    diffs = [100 * (c["cachesmith"] - c[against]) for c in comps]
    wins = [d for d in diffs if d > 1e-9]
    return {"num_settings": len(diffs), "num_wins": len(wins), "num_ties": sum(abs(d) <= 1e-9 for d in diffs),
            "num_losses": sum(d < -1e-9 for d in diffs), "max_gain_pts": max(diffs, default=0.0),
            "median_gain_pts": statistics.median(diffs) if diffs else 0.0,
            "min_gain_pts": min(diffs, default=0.0), "max_win_pts": max(wins, default=0.0),
            "min_win_pts": min(wins, default=0.0)}


def table_md(headers: list[str], lines: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(line) + " |" for line in lines]) + "\n"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def table_summary(table: OutcomeTable) -> str:
    L = table.num_layers
    fp, fr = preset("full_prefill", 1.0, L).label(), preset("full_reuse", 0.0, L).label()
    lines = []
    for task in (*FOUR_TASKS, "mix"):
        os_ = table.by_task(task)
        lines.append([TASK_NAMES[task], str(len(os_)), pct(statistics.fmean(o.plans[fp] for o in os_)),
                      pct(statistics.fmean(o.plans[fr] for o in os_)),
                      f"{statistics.median(o.context_tokens for o in os_):.0f}"])
    return table_md(["task", "instances", "full prefill passes", "full reuse passes", "context tokens p50"], lines)


def per_task_wins(comps: list[dict]) -> str:
    lines = []
    for task in (*FOUR_TASKS, "mix"):
        cs = [c for c in comps if c["task"] == task]
        if not cs:
            continue
        b, f = win_summary(cs, "best_static"), win_summary(cs, "full_prefill")
        lines.append([TASK_NAMES[task], f"{b['num_wins']}/{b['num_settings']}", f"{b['num_losses']}",
                      f"{b['median_gain_pts']:+.1f}", f"{b['max_gain_pts']:+.1f}",
                      f"{f['num_wins']}/{f['num_settings']}", f"{f['median_gain_pts']:+.1f}"])
    return table_md(["task", "beats BestStatic", "loses", "median gain (pts)", "max gain (pts)",
                     "beats Full Prefill", "median gain vs FP (pts)"], lines)


def study_table(rows: list[dict], study: str, keys: tuple[str, ...]) -> str:
    """One line per setting, one column per method: QSA (gate rate / attainment)."""
    rs = [r for r in rows if r["study"] == study]
    methods = list(dict.fromkeys(r["method"] for r in rs))
    by = defaultdict(dict)
    for r in rs:
        by[tuple(r[k] for k in keys)][r["method"]] = r
    lines = []
    for setting, ms in by.items():
        head = [TASK_NAMES.get(str(v), str(v)) for v in setting]
        lines.append(head + [f"{pct(ms[m]['qsa'])} ({pct(ms[m]['gate_rate'])}/{pct(ms[m]['ttft_attainment'])})"
                             if m in ms else "" for m in methods])
    return table_md([*keys, *methods], lines)


def _validation_rows(rows: list[dict]) -> str:
    lines = [[r["setting"], str(r.get("seeds", "")), r["method"], pct(r["qsa_replay"]), pct(r["qsa_sim"]),
              f"{r['qsa_diff_pts']:+.1f}", f"{r['p99_replay_s']:.2f}", f"{r['p99_sim_s']:.2f}",
              f"{100 * r['p99_rel_err']:+.1f}%", f"{pct(r['gate_replay'])} / {pct(r['gate_sim'])}",
              f"{pct(r['att_replay'])} / {pct(r['att_sim'])}", "yes" if r["is_within"] else "**no**"]
             for r in rows]
    return table_md(["setting", "seeds", "method", "QSA replay", "QSA sim", "diff (pts)", "P99 replay s",
                     "P99 sim s", "P99 error", "gate replay / sim", "attainment replay / sim", "within bars"], lines)


def validation_md(payload: dict | None) -> str:
    if not payload:
        return ("_No validation payload (run `python -m benchmarks.sim_validation --out-json "
                "docs/bench/sim_validation.json`)._\n")
    text = _validation_rows(payload["rows"])
    if payload.get("cross_validated"):
        text += ("\nThe same with the machine fit leaving each setting out (on the calibration replays and the other "
                 "two settings' replays, so the machine's drift over the hours the replays took is averaged in):\n\n"
                 + _validation_rows(payload["cross_validated"]))
    if payload.get("per_seed"):
        text += "\nEach seed alone (the noise the means average out):\n\n" + _validation_rows(payload["per_seed"])
    if payload.get("replay_noise"):
        text += ("\nThe replay's own noise: the same trace (same arrivals, SLOs and base) replayed a second time "
                 "and compared with the first under the same bars:\n\n" + _validation_rows(payload["replay_noise"]))
    resid = payload.get("residuals")
    if resid:
        fams = sorted({k for v in resid.values() for k in v})
        text += ("\nMeasured / simulated time of each replay's batches, median per plan family and batch size "
                 "(`@1` single, `@2+` several, `@4k+` / `@8k+` at least that many prompt tokens; batch counts in "
                 "brackets): what the simulator's machine misses on traces it was not fit to. The machine's speed "
                 "drifts: the seed-2 replays, run last, ran 7-20% over it in every family.\n\n" + table_md(["replay", *fams], [[s] + [
                     f"{v[f]['median']:.2f} ({v[f]['num_batches']})" if f in v else "" for f in fams]
                     for s, v in resid.items()]))
    return text


def bandwidth_md(rows: list[dict]) -> str:
    rs = [r for r in rows if r["study"] == "bandwidth"]
    keep = ["cachesmith", "full_prefill", "full_reuse", "cacheblend@0.15", "epic@0.15", "prophetkv@0.15",
            "fusionrag@0.15"]
    lines = []
    for task in dict.fromkeys(r["task"] for r in rs):
        for gbps in sorted({r["bandwidth_gbps"] for r in rs}, reverse=True):
            ms = {r["method"]: r for r in rs if r["task"] == task and r["bandwidth_gbps"] == gbps}
            lines.append([TASK_NAMES[task], f"{gbps:g}"] + [
                f"{pct(ms[m]['qsa'])} / {pct(ms[m]['gate_rate'])} / {100 * ms[m]['stall_fraction']:.0f}%"
                if m in ms else "" for m in keep])
    return table_md(["task", "GB/s", *keep], lines)


def band_md(rows: list[dict]) -> str:
    rs = [r for r in rows if r["study"] == "band"]
    sats = sorted({r["r_max"] for r in rs})
    lines = [[f"{lo:.0%}"] + [pct(next(r["qsa"] for r in rs if r["r_min"] == lo and r["r_max"] == hi)) for hi in sats]
             for lo in sorted({r["r_min"] for r in rs})]
    return table_md(["floor \\ saturation", *[f"{s:.0%}" for s in sats]], lines)
