"""One prepared check of the engine on a GPU: speed against transformers, reuse through the store,
batching, decode, logits agreement and the HTTP server, on random weights of a named shape.

In: --shape (`tiny`: a dry run, on the CPU or the simulated CUDA device; `1b`: Llama-3.2-1B's
layers; `8b`: Llama-3-8B's), --device, --dtype, --contexts, and --tokenizer-dir (default: the
packaged smollm2-135m folder; elsewhere a carried copy of its tokenizer files). The vocabulary is that tokenizer's (49,152), so the server
can tokenize; every other size is the named model's. Random weights (std 0.02, norms 1) are drawn
on the device in the target dtype and saved once as an HF-format folder (config.json,
model.safetensors, the tokenizer's files; in /dev/shm where it has room), which our `Decoder`,
transformers' `AutoModelForCausalLM` (sdpa) and the server all load: our loader and the model
identity read the weights from files, so the folder cannot be skipped. transformers 4.x or 5.x:
the spellings that changed between them are the installed one's (hf_compat).
Out: a table, one line per row, and the JSON payload (--out, stamped by `payload.emit` like every
payload). A row is a dict; one that raised holds `error` (the exception's last line, the traceback
goes to stderr) and the run goes on; one the clock (--max-minutes) or a missing package stopped
holds `skipped`. Then the bars and whether each passed; the exit status is 1 when one failed.
Rows (timings: median of 3 after a warm-up, synchronized on CUDA; the sizes below are 1b's and
8b's, `tiny` runs each leg once at small sizes: SIZES):
  logits   last-position logits of a 2K prompt, ours against transformers': cosine, same top-1,
           top-10 overlap, max |diff|
  graphs   greedy tokens of 8 streams of 2K (64 each), CUDA-graph decode against eager decode
           (`Decoding(use_graphs=True/False)`), in the run's dtype: equal, or where not the first
           differing step and the logit gap there (gpu_paths.tokens_row)
  kernels  one row per kind of attention call the engine made in those runs and in a CacheBlend
           recompute (prefill, recompute, decode eager, decode graph; shapes less their lengths):
           the SDPA kernels torch's checks accept (flash, efficient, cudnn, with their reasons) and
           the one it picks, for every length seen (device.sdpa_kernels; None on the CPU)
  prefill  our full prefill (`Decoder.prefill`) against transformers' forward, per context
  reuse    full reuse, CacheBlend@15%/30%, EPIC@15% and FusionRAG@15% per context, `direct` (chunk
           KV already on the device) and `store` (chunks in a memory-tier `ChunkStore`, staged by
           the `TransferEngine` as serving stages them): ms and the ratio to our full prefill;
           `direct` replays a CUDA graph where the runner does (`is_graphed`) and is timed eager
           and replayed regardless too (`eager_ms`, `eager_ratio`, `forced_ms`,
           `logit_diff_vs_eager`)
  batch    8 requests of 2K: CacheBlend@15% (and our full prefill of the 8) against transformers'
           full prefill of the batch of 8
  decode   tokens/s at 2K for 1 and 8 streams (`Decoding`, greedy) against transformers'
           `generate` (greedy, min_new_tokens = max_new_tokens), both less the first token's cost
  serve    `cachesmith serve` as a child process: 10 RAG requests (4-5 documents drawn from a
           pool of 8, so documents recur in new orders) and one plain chat over loopback (stdlib
           client); each answer's status and `cachesmith` object
Bars: logits cosine >= 0.995; 10/10 RAG requests answered with a plan; on a CUDA device, graph
decode's tokens equal eager decode's (in half precision, a differing step within gpu_paths.TIE_GAP
logits' std passes: the paths round differently and random weights leave near-ties) and no kind of
attention call falls to the math kernel; no row errored.
On the simulated CUDA device (`python -m cachesmith.testing.sim_run benchmarks.gpu_check ...`,
CI: tests/bench/test_gpu_check_sim.py) the server is started under the simulation too (serve_leg).
Usage: python -m benchmarks.gpu_check --shape 8b   (make gpu-check, after make gpu-kit)
       python -m benchmarks.gpu_check --shape tiny --device cpu
       python -m cachesmith.testing.sim_run benchmarks.gpu_check --shape tiny --device cuda
"""
from __future__ import annotations

import argparse
import gc
import platform
from importlib.metadata import PackageNotFoundError, version
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.forecast_rows import beside_forecast
from benchmarks.common.check_rows import Clock, guarded
from benchmarks.common.reuse_rows import Timer, method_rows, release_all
from benchmarks.common.gpu_paths import SdpaRecorder, TIE_GAP, kernel_row, recompute_calls, tokens_row
from benchmarks.common.hf_compat import dtype_kwargs, last_logits_kwargs
from benchmarks.common.payload import emit, print_table
from benchmarks.common.random_model import (SHAPES, build_model, config_fields, default_tokenizer_dir,
                                            scratch_root, weight_bytes)
from benchmarks.common.serve_leg import NUM_RAG, serve_row
from benchmarks.common.timing import median, timed

from cachesmith.calibration.synthetic import random_request
from cachesmith.model import Decoder, Decoding
from cachesmith.model import device as accel
from cachesmith.recompute import BatchRunner, cacheblend, full_prefill

COSINE_BAR = 0.995

@dataclass(frozen=True)
class Sizes:
    """The rows' sizes for a shape: `tiny` runs small enough for CI's simulated device on 2 cores."""
    short: int  # the context of the logits, batch and decode rows
    batch: int  # requests in the batch row
    new_tokens: int  # greedy tokens per stream in the decode rows
    streams: tuple[int, ...]  # one decode row each
    repeats: int  # timed runs per measurement, after a warm-up: their median is the row's
    contexts: tuple[int, ...]  # --contexts' default: the prefill and reuse rows
    doc_words: int  # --doc-words' default: words per served document


FULL = Sizes(short=2048, batch=8, new_tokens=64, streams=(1, 8), repeats=3, contexts=(2048, 8192, 16384),
             doc_words=150)
# a dry run that checks the script, not the speed: every leg once, each measured once
TINY = Sizes(short=256, batch=2, new_tokens=4, streams=(1, 2), repeats=1, contexts=(256,), doc_words=40)
SIZES = {"tiny": TINY, "1b": FULL, "8b": FULL}


# -- the reference model -----------------------------------------------------------------------
def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """transformers' model from the same folder, sdpa attention, loaded on the host and moved to the
    device: its `device_map` (no host copy first) needs `accelerate`, which neither the lock nor the
    GPU kit carries (transformers 5 raises without it). The dtype's argument is spelled as the
    installed transformers spells it (`hf_compat`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa", **dtype_kwargs(dtype))
    return model.to(device).eval()


def last_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the last position of each row of ids [B, T] -> [B, vocab]: only
    that position's computed where the installed version can be told so (`hf_compat`)."""
    return hf(ids, **last_logits_kwargs(hf)).logits[:, -1]


# -- rows --------------------------------------------------------------------------------------
def logits_row(model: Decoder, hf, short: int, device: torch.device) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (short,), generator=torch.Generator().manual_seed(7))
    ours, cache = model.prefill(ids)
    cache.release()
    with torch.inference_mode():
        ref = last_logits(hf, ids.to(device)[None])[0].float()
    top_ours, top_ref = ours.topk(10).indices.tolist(), ref.topk(10).indices.tolist()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=0).item()
    return {"tokens": short, "cosine": cosine, "same_top1": top_ours[0] == top_ref[0],
            "top10_overlap": len(set(top_ours) & set(top_ref)) / 10,
            "max_abs_diff": (ours - ref).abs().max().item(), "passed": cosine >= COSINE_BAR}


def prefill_row(model: Decoder, hf, flat: list[int], timer: Timer) -> dict:
    ids = torch.tensor(flat, device=timer.device)
    engine = timer.ms(lambda: model.prefill(ids)[1].release())
    with torch.inference_mode():
        ref = timer.ms(lambda: last_logits(hf, ids[None]))
    return {"tokens": len(flat), "engine_ms": engine, "hf_ms": ref, "hf_over_engine": ref / engine}


def context_rows(rows, clock, reserve_s, model, hf, runner, context: int, timer: Timer) -> None:
    """At one context: the request (chunk KV computed off the clock), the prefill row, the methods."""
    made: dict = {}

    def make():
        made["req"], made["flat"] = random_request(model, [], context, random.Random(context))
        return {"context_tokens": context, "num_chunks": len(made["req"].chunks)}
    guarded(rows, clock, "setup", f"request {context}", make, reserve_s)
    if "req" not in made:
        return
    req, flat = made["req"], made["flat"]
    pre = guarded(rows, clock, "prefill", f"{context}", lambda: prefill_row(model, hf, flat, timer), reserve_s)
    method_rows(rows, clock, reserve_s, model, runner, req, context, pre.get("engine_ms"), timer)


def batch_row(model: Decoder, hf, runner: BatchRunner, sizes: Sizes, timer: Timer) -> dict:
    made = [random_request(model, [], sizes.short, random.Random(100 + i)) for i in range(sizes.batch)]
    reqs, ids = [r for r, _ in made], torch.tensor([f for _, f in made], device=timer.device)
    blend = timer.ms(lambda: release_all(runner.run(reqs, cacheblend(0.15))))
    full = timer.ms(lambda: release_all(runner.run(reqs, full_prefill(model.num_layers))))
    with torch.inference_mode():
        ref = timer.ms(lambda: last_logits(hf, ids))
    return {"batch_size": sizes.batch, "context_tokens": sizes.short, "tokens_each": ids.shape[1],
            "cacheblend_ms": blend, "engine_full_ms": full, "hf_ms": ref, "hf_over_cacheblend": ref / blend,
            "hf_over_engine_full": ref / full}


def engine_decode_s(model: Decoder, ids: torch.Tensor, streams: int, new_tokens: int, timer: Timer) -> float:
    """Seconds for `streams` sequences to take `new_tokens` greedy tokens each over copies of one
    prefilled cache (the first token comes from the prefill's logits: new_tokens - 1 steps)."""
    logits, base = model.prefill(ids, extra_capacity=new_tokens + 4)

    def once() -> float:
        caches = [base.clone() for _ in range(streams)]  # copies made off the clock

        def run():
            decoding = Decoding(model)
            for cache in caches:
                decoding.start(logits, cache, new_tokens, eos_token_ids=())
            decoding.run()
        seconds = timed(run, timer.device)
        for cache in caches:
            cache.release()
        return seconds
    once()
    seconds = median([once() for _ in range(timer.repeats)])
    base.release()
    return seconds


def hf_decode_s(hf, ids: torch.Tensor, streams: int, new_tokens: int, timer: Timer) -> float:
    """transformers' generate of `new_tokens` less that of 1 token (its prefill and first token)."""
    x = ids.to(timer.device)[None].repeat(streams, 1)

    def generate(n: int):
        return lambda: hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        return timer.seconds(generate(new_tokens)) - timer.seconds(generate(1))


def decode_row(model: Decoder, hf, streams: int, sizes: Sizes, timer: Timer) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (sizes.short,), generator=torch.Generator().manual_seed(11))
    n = sizes.new_tokens
    steps = streams * (n - 1)
    ours, ref = steps / engine_decode_s(model, ids, streams, n, timer), steps / hf_decode_s(hf, ids, streams, n, timer)
    return {"context_tokens": sizes.short, "streams": streams, "new_tokens": n, "engine_tokens_per_s": ours,
            "hf_tokens_per_s": ref, "engine_over_hf": ours / ref}


def path_rows(rows, clock, reserve_s, model: Decoder, runner: BatchRunner, sizes: Sizes, device) -> None:
    """Graph decode's tokens against eager decode's, then one row per kind of attention call the
    engine made meanwhile (and in a CacheBlend run): the SDPA kernels torch gives it (`gpu_paths`)."""
    recorder, streams = SdpaRecorder(), max(sizes.streams)
    guarded(rows, clock, "graphs", f"{streams} stream(s) {sizes.short}",
            lambda: tokens_row(model, sizes.short, streams, sizes.new_tokens, recorder), reserve_s)
    guarded(rows, clock, "setup", f"recompute calls {sizes.short}",
            lambda: recompute_calls(model, runner, sizes.short, recorder), reserve_s)
    for case, calls in recorder.kinds().items():
        guarded(rows, clock, "kernels", case, lambda: kernel_row(calls, device), reserve_s)


def engine_rows(rows: list[dict], clock: Clock, args, model_dir: Path, device, dtype, info: dict) -> None:
    """Every row that runs in this process: our decoder and transformers' side by side."""
    reserve_s = 0.0 if args.skip_serve else min(150.0, 0.35 * clock.budget_s)  # kept for the serve leg
    loaded: dict = {}

    def load():
        start = time.perf_counter()
        loaded["model"] = Decoder(model_dir, device, dtype)
        middle = time.perf_counter()
        loaded["hf"] = load_hf(model_dir, device, dtype)
        info.update(engine_load_s=middle - start, hf_load_s=time.perf_counter() - middle)
        return {k: info[k] for k in ("engine_load_s", "hf_load_s")}
    guarded(rows, clock, "setup", "load", load)
    if len(loaded) < 2:
        return
    model, hf = loaded["model"], loaded["hf"]
    runner = BatchRunner(model)
    sizes = args.sizes
    timer = Timer(device, sizes.repeats)
    guarded(rows, clock, "logits", f"{sizes.short}", lambda: logits_row(model, hf, sizes.short, device), reserve_s)
    path_rows(rows, clock, reserve_s, model, runner, sizes, device)
    for context in args.contexts:
        context_rows(rows, clock, reserve_s, model, hf, runner, context, timer)
    guarded(rows, clock, "batch", f"{sizes.batch}x{sizes.short} cacheblend@0.15",
            lambda: batch_row(model, hf, runner, sizes, timer), reserve_s)
    for streams in sizes.streams:
        guarded(rows, clock, "decode", f"{streams} stream(s) {sizes.short}",
                lambda: decode_row(model, hf, streams, sizes, timer), reserve_s)
    del model, hf, runner, loaded
    gc.collect()
    accel.empty_cache(device)  # the server gets the device to itself


# -- the run -----------------------------------------------------------------------------------
def device_bars(rows: list[dict], dtype: str) -> list[dict]:
    """The bars of a CUDA device's paths: graph decode's tokens, the fused attention kernels."""
    graphs = next((r for r in rows if r["leg"] == "graphs"), {})
    kernels = [r for r in rows if r["leg"] == "kernels"]
    near = f", or within {TIE_GAP} logits' std where they differ" if dtype != "float32" else ""
    return [{"bar": f"graph decode's greedy tokens == eager decode's ({dtype}{near})",
             "value": graphs.get("tokens_equal"), "passed": bool(graphs.get("passed"))},
            {"bar": "every kind of engine attention call gets a fused SDPA kernel (not math)",
             "value": [r["case"] for r in kernels if not r.get("passed")],
             "passed": bool(kernels) and all(r.get("passed") for r in kernels)}]


def bars(rows: list[dict], skip_serve: bool, on_cuda: bool = False, dtype: str = "float32") -> list[dict]:
    """Each bar, its value and whether it passed; the serve bar unless skipped, the device's paths'
    bars on a CUDA device (on the CPU both decode paths are eager and the kernels another set)."""
    logits = next((r for r in rows if r["leg"] == "logits"), {})
    serve = next((r for r in rows if r["leg"] == "serve"), {})
    errored = [f"{r['leg']} {r['case']}" for r in rows if "error" in r]
    out = [{"bar": f"logits cosine >= {COSINE_BAR}", "value": logits.get("cosine"),
            "passed": bool(logits.get("passed"))}]
    if not skip_serve:
        out.append({"bar": f"{NUM_RAG}/{NUM_RAG} RAG requests answered with a plan",
                    "value": serve.get("answered_with_plan", "skipped: " + serve["skipped"] if "skipped" in serve
                                       else None),
                    "passed": bool(serve.get("passed"))})
    if on_cuda:
        out += device_bars(rows, dtype)
    return out + [{"bar": "no row errored", "value": errored, "passed": not errored}]


def _fmt(v, unit: str = "", label: str = "") -> str:
    if v is None:
        return ""
    return label + (f"{v:.4g}" if isinstance(v, float) else f"{v}") + unit


def display(row: dict) -> dict:
    """One table line: what ours did, the reference, their ratio, the status."""
    r = row
    shown = {"logits": (_fmt(r.get("cosine"), label="cos "), _fmt(r.get("top10_overlap"), label="top-10 overlap "),
                        _fmt(r.get("max_abs_diff"), label="max diff ")),
             "prefill": (_fmt(r.get("engine_ms"), " ms"), _fmt(r.get("hf_ms"), " ms", "hf "),
                         _fmt(r.get("hf_over_engine"))),
             "reuse": (_fmt(r.get("ms"), " ms"), _fmt(r.get("full_prefill_ms"), " ms", "full "), _fmt(r.get("ratio"))),
             "batch": (_fmt(r.get("cacheblend_ms"), " ms"), _fmt(r.get("hf_ms"), " ms", "hf "),
                       _fmt(r.get("hf_over_cacheblend"))),
             "decode": (_fmt(r.get("engine_tokens_per_s"), " tok/s"), _fmt(r.get("hf_tokens_per_s"), " tok/s", "hf "),
                        _fmt(r.get("engine_over_hf"))),
             "graphs": (_fmt(r.get("tokens_equal"), label="tokens equal "), _fmt(r.get("graph_replays"), " replays"),
                        _fmt(r.get("dtype"))),
             "kernels": (_fmt(",".join(r["picked"]) if r.get("picked") else None, label="picked "),
                         _fmt(r.get("calls"), " calls"), _fmt(r.get("dtype"))),
             "serve": (_fmt(r.get("answered_with_plan"), f"/{NUM_RAG} planned"),
                       _fmt((r.get("chat") or {}).get("status"), label="chat "), _fmt(r.get("startup_s"), " s up"))}
    ours, ref, ratio = shown.get(row["leg"], ("", "", ""))
    status = ("error: " + r["error"][:80]) if "error" in r else ("skipped: " + r["skipped"]) if "skipped" in r else \
        ("FAIL" if r.get("passed") is False else "ok")
    return {"leg": row["leg"], "case": r["case"], "ours": ours, "reference": ref, "ratio": ratio, "status": status}


STACK = ("transformers", "tokenizers", "huggingface-hub", "safetensors")  # what the rows import beyond torch


def installed_version(name: str) -> str | None:
    """The installed distribution's version, None where it is missing (the rows needing it say so)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions(device: torch.device) -> dict:
    """Python, torch, the stack beyond it (None where missing: a torch-only image still writes its
    rows, each that needs a missing package with its error) and the device."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            **{name: installed_version(name) for name in STACK}, **accel.describe(device)}


def parse_args() -> argparse.Namespace:
    cuda = accel.is_cuda_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default: the shape's (SIZES)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="default: the packaged smollm2-135m folder")
    ap.add_argument("--doc-words", type=int, default=None, help="words per served document (default: the shape's)")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="rows that would start later are skipped")
    ap.add_argument("--json", action="store_true", help="print only the JSON payload")
    ap.add_argument("--out", default="docs/bench/gpu_check.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.sizes = SIZES[args.shape]
    args.contexts = args.contexts or list(args.sizes.contexts)
    args.doc_words = args.doc_words or args.sizes.doc_words
    args.tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    return args


def main() -> int:
    args = parse_args()
    clock, rows = Clock(args.max_minutes), []
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    payload = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "contexts": args.contexts,
               "versions": versions(device), "tokenizer_dir": str(args.tokenizer_dir)}
    root = scratch_root(weight_bytes(config_fields(args.shape, args.tokenizer_dir), dtype))
    with tempfile.TemporaryDirectory(prefix="cachesmith-gpu-check-", dir=root) as tmp:
        work, built = Path(tmp), {}

        def build():
            built["dir"], payload["setup"] = build_model(args, work, device, dtype)
            return {k: v for k, v in payload["setup"].items() if k != "config"}
        guarded(rows, clock, "setup", "build", build)
        if "dir" in built:
            engine_rows(rows, clock, args, built["dir"], device, dtype, payload["setup"])
            if not args.skip_serve:
                guarded(rows, clock, "serve", f"{NUM_RAG} RAG + 1 chat",
                        lambda: serve_row(args, built["dir"], work, clock))
    payload["forecast"] = beside_forecast(rows, payload["versions"].get("gpu") or "")  # the first GPU grades it
    payload["rows"], payload["bars"] = rows, bars(rows, args.skip_serve, accel.is_cuda(device), args.dtype)
    payload["passed"] = all(b["passed"] for b in payload["bars"])

    def table():
        print_table([display(r) for r in rows], ["leg", "case", "ours", "reference", "ratio", "status"])
        print()
        print_table([{"bar": b["bar"], "value": len(b["value"]) if isinstance(b["value"], list) else _fmt(b["value"]),
                      "passed": "pass" if b["passed"] else "FAIL"} for b in payload["bars"]],
                    ["bar", "value", "passed"])
    emit(payload, args.json, args.out, table)
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
