"""Selective recomputation on the packaged model: speed of every preset, accuracy vs coverage.

Speed: TTFT of each preset at r in {5,15,30,50}% (or --coverages) against our full prefill (timed
interleaved with each plan), at 1K/2K/4K context tokens in 256-512-token chunks, float32 and bfloat16;
`ideal_fraction` = w/L + (1-w/L)(rN+n)/(N+n).
Accuracy: the multi-needle task (several needles in different chunks, ask for one key) over
--instances instances, including the kv_dev K / V / K+V study. Accuracy results are cached on disk
(JSONL), so an interrupted run resumes. `--json` prints {"speed": [...], "accuracy": [...]}.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, timed

from cachesmith.calibration.synthetic import random_request
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import preset
from cachesmith.scoring import score
from cachesmith.workloads.corpus import load_corpus
from cachesmith.workloads.needles import multi_needle

COVERAGES = [0.05, 0.15, 0.30, 0.50]
SELECTIVE = ["cacheblend", "epic", "prophetkv", "fusionrag"]


def run_speed(model_name: str, dtypes: list[str], sizes: list[int], repeats: int,
              methods: list[str], coverages: list[float] = COVERAGES) -> list[dict]:
    rows = []
    for dtype in dtypes:
        pipe = RagPipeline(model_name, "cpu", dtype)
        L = pipe.model.num_layers
        for n_ctx in sizes:
            prefix = pipe.prompt(["x"], "q").prefix_ids
            req, flat = random_request(pipe.model, prefix, n_ctx, random.Random(n_ctx))
            n = len(req.suffix_ids)
            plans = [("full_reuse", 0.0)] + [(m, r) for m in methods for r in coverages]
            for method, r in tqdm(plans, desc=f"speed {dtype} {n_ctx}", file=sys.stderr):
                plan = preset(method, r, L)
                pipe.runner.run([req], plan)  # warm
                runs, fulls = [], []
                for _ in range(repeats):  # interleaved with full prefill: drift hits both sides
                    runs.append(timed(lambda: pipe.runner.run([req], plan)))
                    fulls.append(timed(lambda: pipe.model.prefill(flat)))
                t, full = median(runs), median(fulls)
                w = min(plan.warmup, L) if plan.signal.value != "kv_dev" else plan.warmup + plan.probe
                ideal = w / L + (1 - w / L) * (r * n_ctx + n) / (n_ctx + n)
                rows.append({"method": method, "coverage": r, "context_tokens": n_ctx, "dtype": dtype,
                             "ttft_s": t, "full_prefill_s": full, "ideal_fraction": ideal,
                             "fraction": t / full, "vs_ideal": t / full / ideal})
    return rows


def _accuracy_plans(L: int) -> list[tuple[str, float, object]]:
    """Every preset; cacheblend once per KV-deviation target (K, V, K+V), named explicitly so cached
    answers never mix targets."""
    plans = [("full_prefill", 1.0, preset("full_prefill", 1.0, L)), ("full_reuse", 0.0, preset("full_reuse", 0.0, L))]
    for r in COVERAGES:
        for m in SELECTIVE[1:]:
            plans.append((m, r, preset(m, r, L)))
        for target in ("k", "v", "kv"):
            plans.append((f"cacheblend[{target}]", r, replace(preset("cacheblend", r, L), kv_dev_target=target)))
    return plans


def run_accuracy(model_name: str, dtype: str, num_instances: int, cache_path: Path) -> list[dict]:
    pipe = RagPipeline(model_name, "cpu", dtype)
    corpus = load_corpus()
    if corpus.is_synthetic:
        print("warning: Wikipedia extracts unavailable, using the synthetic corpus", file=sys.stderr)
    done: dict[str, bool] = {}
    if cache_path.exists():
        for line in cache_path.read_text().splitlines():
            rec = json.loads(line)
            done[rec["key"]] = rec["correct"]
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    plans = _accuracy_plans(pipe.model.num_layers)
    tag = f"{pipe.model.fingerprint}:{dtype}:{'syn' if corpus.is_synthetic else 'wiki'}"
    with cache_path.open("a") as fh, tqdm(total=num_instances * len(plans), desc="accuracy", file=sys.stderr) as bar:
        for seed in range(num_instances):
            inst = multi_needle(corpus, seed)
            for method, r, plan in plans:
                key = f"{tag}:{seed}:{method}:{r}"
                if key not in done:
                    ans = pipe.answer(inst.documents, inst.question, plan, max_new_tokens=10,
                                      answer_prefix=inst.answer_prefix)
                    done[key] = score(inst, ans.text).passed
                    fh.write(json.dumps({"key": key, "correct": done[key], "answer": ans.text}) + "\n")
                    fh.flush()
                bar.update()
    rows = []
    for method, r, _ in plans:
        hits = [done[f"{tag}:{s}:{method}:{r}"] for s in range(num_instances)]
        rows.append({"method": method, "coverage": r, "accuracy": sum(hits) / len(hits), "n": len(hits)})
    return rows


def plot(speed: list[dict], acc: list[dict], path: Path) -> None:
    """Accuracy vs coverage (paper Fig. 3 style) and TTFT fraction vs coverage, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if acc:
        ax = axes[0]
        ends = {r["method"]: r["accuracy"] for r in acc if r["method"] in ("full_prefill", "full_reuse")}
        for name, style in (("full_prefill", "--"), ("full_reuse", ":")):
            if name in ends:
                ax.axhline(ends[name], color="gray", linestyle=style, label=name.replace("_", " "))
        for method in sorted({r["method"] for r in acc} - set(ends)):
            pts = sorted((r["coverage"], r["accuracy"]) for r in acc if r["method"] == method)
            ax.plot([100 * c for c, _ in pts], [a for _, a in pts], marker="o", label=method)
        ax.set(xlabel="coverage r (%)", ylabel=f"accuracy (n={acc[0]['n']})", title="multi-needle accuracy")
        ax.legend(fontsize=7)
    if speed:
        ax = axes[1]
        big = max(r["context_tokens"] for r in speed)
        for (method, dtype) in sorted({(r["method"], r["dtype"]) for r in speed if r["method"] != "full_reuse"}):
            pts = sorted((r["coverage"], r["fraction"]) for r in speed
                         if r["method"] == method and r["dtype"] == dtype and r["context_tokens"] == big)
            ax.plot([100 * c for c, _ in pts], [f for _, f in pts], marker="o",
                    linestyle="-" if dtype == "float32" else "--", label=f"{method} {dtype}")
        ideal = sorted((r["coverage"], r["ideal_fraction"]) for r in speed
                       if r["method"] == "cacheblend" and r["dtype"] == "float32" and r["context_tokens"] == big)
        ax.plot([100 * c for c, _ in ideal], [f for _, f in ideal], color="black", label="ideal (kv_dev,1,0,r)")
        ax.set(xlabel="coverage r (%)", ylabel="TTFT / full prefill", title=f"speed at {big} context tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["speed", "accuracy", "both"], default="both")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=SELECTIVE, choices=SELECTIVE)
    ap.add_argument("--coverages", type=float, nargs="+", default=COVERAGES, help="speed part only")
    ap.add_argument("--instances", type=int, default=40)
    ap.add_argument("--accuracy-dtype", default="float32")
    ap.add_argument("--cache", default="results/recompute_accuracy.jsonl")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="results/recompute.json")
    ap.add_argument("--plot", default="results/recompute.png", help="PNG path ('' for none)")
    args = ap.parse_args()
    torch.manual_seed(0)
    speed = run_speed(args.model, args.dtypes, args.sizes, args.repeats, args.methods,
                      args.coverages) if args.part != "accuracy" else []
    acc = run_accuracy(args.model, args.accuracy_dtype, args.instances, Path(args.cache)) if args.part != "speed" else []

    def tables():
        if speed:
            print_table(speed, ["method", "coverage", "context_tokens", "dtype", "ttft_s", "full_prefill_s",
                                "fraction", "ideal_fraction", "vs_ideal"])
        if acc:
            print_table(acc, ["method", "coverage", "accuracy", "n"])
    emit({"speed": speed, "accuracy": acc}, args.json, args.out, tables)
    if args.plot:
        plot(speed, acc, Path(args.plot))


if __name__ == "__main__":
    main()
