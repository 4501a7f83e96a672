"""Tables and plots of a bench: a markdown table of the summary rows, and a figure with QSA per
method (one group of bars per SLO scale) next to gate rate against TTFT attainment (QSA needs both).

In: a `BenchResult`. Out: markdown text, a PNG file.
"""
from __future__ import annotations

from pathlib import Path

from cachesmith.bench.run import BenchResult

COLUMNS = (("method", "{}"), ("slo_scale", "{:g}x"), ("qsa", "{:.0%}"), ("ttft_attainment", "{:.0%}"),
           ("gate_rate", "{:.0%}"), ("ttft_p50_s", "{:.2f}"), ("ttft_p90_s", "{:.2f}"), ("ttft_p99_s", "{:.2f}"),
           ("throughput_rps", "{:.3f}"), ("stall_fraction", "{:.1%}"), ("decision_ms_p99", "{:.2f}"),
           ("recompute_fraction", "{:.0%}"), ("mean_batch_size", "{:.1f}"))
HEADERS = ("method", "SLO", "QSA", "TTFT att.", "gate", "P50 s", "P90 s", "P99 s", "req/s", "stall",
           "decision ms p99", "recomputed", "batch")


def markdown(result: BenchResult) -> str:
    cfg = result.config
    lines = [f"# Bench: {cfg.name}", "",
             f"{cfg.num_requests} requests, {cfg.pattern}" + (f" CV {cfg.cv:g}" if cfg.pattern == "gamma" else "")
             + f" arrivals at utilization {cfg.utilization:g}, gate `{cfg.gate}`, base SLO "
             f"{result.base_slo_s:.2f} s (mean single-request full-prefill TTFT here), profile "
             f"{result.profile_source} (speed factor {result.speed_factor:.2f}), replay clock.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in result.rows:
        cells = [fmt.format(row[key]) for key, fmt in COLUMNS]
        if row["method"] == "best_static":
            cells[0] = f"BestStatic ({row['config']})"
        lines.append("| " + " | ".join(cells) + " |")
    errors = [r for r in result.records if r["error"]]
    if errors:
        lines += ["", f"{len({r['request_id'] for r in errors})} request(s) refused, e.g.: {errors[0]['error']}"]
    return "\n".join(lines) + "\n"


def plot(result: BenchResult, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r["method"] != "best_static"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    scales = sorted({r["slo_scale"] for r in rows})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    width = 0.8 / len(scales)
    for j, scale in enumerate(scales):
        by = {r["method"]: r["qsa"] for r in rows if r["slo_scale"] == scale}
        ax.bar([i + j * width for i in range(len(methods))], [by.get(m, 0) for m in methods], width,
               label=f"SLO {scale:g}x base")
    for j, best in enumerate(r for r in result.rows if r["method"] == "best_static"):
        ax.axhline(best["qsa"], ls="--", lw=1, color=f"C{j}", label=f"BestStatic {best['slo_scale']:g}x ({best['config']})")
    ax.set_xticks([i + width * (len(scales) - 1) / 2 for i in range(len(methods))], methods, rotation=40, ha="right")
    ax.set_ylabel("QSA (on time and gate passed)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(result.config.name)
    for r in rows:
        is_cs = r["method"] == "cachesmith"
        ax2.scatter(r["ttft_attainment"], r["gate_rate"], marker="*" if is_cs else "o", s=160 if is_cs else 40,
                    color="crimson" if is_cs else "tab:blue")
        ax2.annotate(f"{r['method']} {r['slo_scale']:g}x", (r["ttft_attainment"], r["gate_rate"]), fontsize=7)
    ax2.set_xlabel("TTFT SLO attainment")
    ax2.set_ylabel("quality gate rate")
    ax2.set_xlim(-0.02, 1.02)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("accuracy vs attainment")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
