"""Figures of the simulated evaluation (matplotlib, PNG): QSA vs SLO scale per task and arrival
pattern, accuracy vs attainment, P99 TTFT, the bandwidth study and the budget-band sweep.

In: the grid's rows (`bench.grid`). Out: PNG files; each function returns its path.
"""
from __future__ import annotations

from pathlib import Path

from cachesmith.bench.results import TASK_NAMES, comparisons, settings


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def qsa_vs_slo(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    comps = comparisons(rows)
    tasks = list(dict.fromkeys(c["task"] for c in comps))
    arrivals = list(dict.fromkeys(c["arrival"] for c in sorted(comps, key=lambda c: (c["arrival"][0] != "P",
                                                                                    c["arrival"]))))
    fig, axes = plt.subplots(len(tasks), len(arrivals), figsize=(2.6 * len(arrivals), 2.2 * len(tasks)),
                             sharex=True, sharey=True, squeeze=False)
    for i, task in enumerate(tasks):
        for j, arr in enumerate(arrivals):
            ax = axes[i][j]
            cs = sorted((c for c in comps if c["task"] == task and c["arrival"] == arr), key=lambda c: c["slo_scale"])
            x = [c["slo_scale"] for c in cs]
            ax.fill_between(x, [c["band_min"] for c in cs], [c["band_max"] for c in cs], color="0.85",
                            label="static band")
            ax.plot(x, [c["full_prefill"] for c in cs], color="0.4", marker=".", label="Full Prefill")
            ax.plot(x, [c["best_static"] for c in cs], color="tab:blue", ls="--", marker="s", ms=3, label="BestStatic")
            ax.plot(x, [c["cachesmith"] for c in cs], color="crimson", marker="*", label="CacheSmith")
            ax.set_ylim(0, 1)
            if i == 0:
                ax.set_title(arr, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{TASK_NAMES[task]} QSA")
            if i == len(tasks) - 1:
                ax.set_xlabel("SLO scale")
    axes[0][0].legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def accuracy_vs_attainment(rows: list[dict], path: Path, arr: str = "Poisson u0.7", scale: float = 2.0) -> Path:
    plt = _plt()
    by = settings(rows)
    tasks = [t for t in TASK_NAMES if (t, arr, scale) in by]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.3 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for m, r in by[(task, arr, scale)].items():
            is_cs = m == "cachesmith"
            ax.scatter(r["ttft_attainment"], r["gate_rate"], marker="*" if is_cs else "o", s=150 if is_cs else 25,
                       color="crimson" if is_cs else ("0.4" if m.startswith("full") else "tab:blue"), zorder=3)
            ax.annotate(m.replace("@", " "), (r["ttft_attainment"], r["gate_rate"]), fontsize=6)
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("TTFT SLO attainment")
        ax.set_title(f"{TASK_NAMES[task]} ({arr}, SLO {scale:g}x)", fontsize=9)
    axes[0][0].set_ylabel("quality gate rate (accuracy)")
    return _save(fig, path)


def p99_ttft(rows: list[dict], path: Path, arr: str = "Gamma CV3", scale: float = 2.0) -> Path:
    plt = _plt()
    by = settings(rows)
    tasks = [t for t in TASK_NAMES if (t, arr, scale) in by]
    methods = list(by[(tasks[0], arr, scale)])
    fig, ax = plt.subplots(figsize=(12, 3.8))
    width = 0.8 / len(tasks)
    for k, task in enumerate(tasks):
        ms = by[(task, arr, scale)]
        ax.bar([i + k * width for i in range(len(methods))], [ms[m]["ttft_p99_s"] for m in methods], width,
               label=TASK_NAMES[task])
    ax.set_xticks([i + width * (len(tasks) - 1) / 2 for i in range(len(methods))], methods, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("P99 TTFT (s, simulated)")
    ax.set_title(f"P99 TTFT per method, {arr}, SLO {scale:g}x base")
    ax.legend(fontsize=8)
    return _save(fig, path)


def bandwidth_study(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    rs = [r for r in rows if r["study"] == "bandwidth"]
    tasks = list(dict.fromkeys(r["task"] for r in rs))
    keep = ["cachesmith", "full_prefill", "cacheblend@0.15", "epic@0.15", "prophetkv@0.15", "fusionrag@0.15"]
    metrics = (("qsa", "QSA"), ("gate_rate", "accuracy (gate rate)"), ("stall_fraction", "stall fraction"))
    fig, axes = plt.subplots(len(tasks), 3, figsize=(12, 2.8 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for m in keep:
                pts = sorted((r["bandwidth_gbps"], r[key]) for r in rs if r["task"] == task and r["method"] == m)
                if pts:
                    ax.plot(*zip(*pts), marker="*" if m == "cachesmith" else ".", label=m,
                            color="crimson" if m == "cachesmith" else None, lw=2 if m == "cachesmith" else 1)
            ax.set_xscale("log")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{TASK_NAMES[task]}: {label}", fontsize=9)
            ax.set_xlabel("KV link GB/s")
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def band_sweep(rows: list[dict], path: Path) -> Path:
    plt = _plt()
    rs = [r for r in rows if r["study"] == "band"]
    floors, sats = sorted({r["r_min"] for r in rs}), sorted({r["r_max"] for r in rs})
    grid = [[next(r["qsa"] for r in rs if r["r_min"] == lo and r["r_max"] == hi) for hi in sats] for lo in floors]
    fig, ax = plt.subplots(figsize=(4.6, 3.6))
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, origin="lower")
    for a in range(len(floors)):
        for b in range(len(sats)):
            ax.text(b, a, f"{grid[a][b]:.0%}", ha="center", va="center", color="w", fontsize=9)
    ax.set_xticks(range(len(sats)), [f"{s:.0%}" for s in sats])
    ax.set_yticks(range(len(floors)), [f"{f:.0%}" for f in floors])
    ax.set_xlabel("saturation point r_max")
    ax.set_ylabel("budget floor r_min")
    ax.set_title("CacheSmith QSA, PR, Gamma CV3, SLO 2x", fontsize=9)
    fig.colorbar(im)
    return _save(fig, path)
