"""`make demo`: the main job on the packaged model: a short bench on MIX comparing CacheSmith with
every baseline on the replay clock (about 4 minutes on 2 CPU cores, after the model and corpus
are fetched).

Requests from the four tasks (PR, MSQ, VT, MV, in equal shares) arrive as a bursty Gamma process
at a utilization near 1 of full prefill; each must answer within its SLO (a multiple of the mean
single-request full-prefill TTFT measured here) and pass its task's quality gate. Prints the table
(QSA, attainment, gate rate, TTFT percentiles, ...) and writes JSON, markdown and a plot.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from cachesmith.bench import BenchConfig, markdown, plot, run_bench
from cachesmith.methods import SELECTIVE
from cachesmith.pipeline import RagPipeline

DEMO = BenchConfig(task="mix", num_requests=20, pattern="gamma", cv=2.0, utilization=1.0, slo_scales=(2.0,),
                   methods=("cachesmith", "full_prefill", "full_reuse", *(f"{p}@0.15" for p in SELECTIVE)),
                   num_base_samples=4)


def main(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
         out: Path = Path("bench-results/demo")) -> int:
    pipe = RagPipeline(model, device, dtype)
    shutil.rmtree(out, ignore_errors=True)  # the main job measures afresh every time, base SLO included
    print(f"model {model} ({dtype}, {device}); bench {DEMO.name}: {DEMO.num_requests} MIX requests, "
          f"Gamma CV {DEMO.cv:g} arrivals at utilization {DEMO.utilization:g}, SLO {DEMO.slo_scales[0]:g}x base; "
          f"methods: {', '.join(DEMO.methods)}")
    result = run_bench(pipe, DEMO, out)
    text = markdown(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text, encoding="utf-8")
    figure = plot(result, out / "qsa.png")
    print(text)
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {figure}")
    return 0
