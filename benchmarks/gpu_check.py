"""One prepared check of the engine on a GPU: speed against transformers, reuse through the store,
batching, decode, logits agreement and the HTTP server, on random weights of a named shape.

In: --shape (`tiny`: a CPU dry run; `1b`: Llama-3.2-1B's layers; `8b`: Llama-3-8B's), --device,
--dtype, --contexts, and --tokenizer-dir (default: the packaged smollm2-135m folder; elsewhere a
carried copy of its tokenizer files). The vocabulary is that tokenizer's (49,152), so the server
can tokenize; every other size is the named model's. Random weights (std 0.02, norms 1) are drawn
on the device in the target dtype and saved once as an HF-format folder (config.json,
model.safetensors, the tokenizer's files; in /dev/shm where it has room), which our `Decoder`,
transformers' `AutoModelForCausalLM` (sdpa) and the server all load: our loader and the model
identity read the weights from files, so the folder cannot be skipped.
Out: a table, one line per row, and the JSON payload (--out, stamped by `common.emit` like every
payload). A row is a dict; one that raised holds `error` (the exception's last line, the traceback
goes to stderr) and the run goes on; one the clock (--max-minutes) or a missing package stopped
holds `skipped`. Then the bars and whether each passed; the exit status is 1 when one failed.
Rows (timings: median of 3 after a warm-up, synchronized on CUDA):
  logits   last-position logits of a 2K prompt, ours against transformers': cosine, same top-1,
           top-10 overlap, max |diff|
  prefill  our full prefill (`Decoder.prefill`) against transformers' forward, per context
  reuse    full reuse, CacheBlend@15%/30% and EPIC@15% per context, `direct` (chunk KV already on
           the device) and `store` (chunks in a memory-tier `ChunkStore`, staged by the
           `TransferEngine` as serving stages them): ms and the ratio to our full prefill
  batch    8 requests of 2K: CacheBlend@15% (and our full prefill of the 8) against transformers'
           full prefill of the batch of 8
  decode   tokens/s at 2K for 1 and 8 streams (`Decoding`, greedy) against transformers'
           `generate` (greedy, min_new_tokens = max_new_tokens), both less the first token's cost
  serve    `cachesmith serve` as a child process: 10 RAG requests (4-5 documents drawn from a
           pool of 8, so documents recur in new orders) and one plain chat over loopback (stdlib
           client); each answer's status and `cachesmith` object
Bars: logits cosine >= 0.995; 10/10 RAG requests answered with a plan; no row errored.
Usage: python benchmarks/gpu_check.py --shape 8b   (make gpu-check)
       python benchmarks/gpu_check.py --shape tiny --device cpu --dtype float32 --contexts 256 512
"""
from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, median, print_table, random_request, timed  # noqa: E402
from random_model import (SHAPES, build_model, default_tokenizer_dir, llama_config, scratch_root,  # noqa: E402
                          weight_bytes)
from serve_leg import NUM_RAG, serve_row  # noqa: E402

from cachesmith.model import Decoder, Decoding  # noqa: E402
from cachesmith.recompute import BatchRunner, cacheblend, epic, full_prefill, full_reuse  # noqa: E402

SHORT = 2048  # the context of the logits, batch and decode rows
BATCH, STREAMS, NEW_TOKENS = 8, (1, 8), 64
COSINE_BAR = 0.995
METHODS = {"full_reuse": full_reuse(), "cacheblend@0.15": cacheblend(0.15), "cacheblend@0.3": cacheblend(0.3),
           "epic@0.15": epic(0.15)}


class Clock:
    """The run's budget: each row asks it before starting and is skipped once it is spent."""

    def __init__(self, minutes: float) -> None:
        self.start, self.budget_s = time.monotonic(), 60 * minutes

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)


def guarded(rows: list[dict], clock: Clock, leg: str, case: str, measure: Callable[[], dict],
            reserve_s: float = 0.0) -> dict:
    """Run one row: its fields, or `skipped` when under `reserve_s` of the budget is left, or
    `error` (the exception's last line) when it raised; the run goes on either way."""
    row = {"leg": leg, "case": case}
    if clock.left() <= reserve_s:
        row["skipped"] = "time"
    else:
        start = time.monotonic()
        try:
            row.update(measure())
        except Exception as exc:  # every row is recorded, whatever broke in it
            traceback.print_exc()
            row["error"] = traceback.format_exception_only(exc)[-1].strip()
        row["wall_s"] = round(time.monotonic() - start, 2)
    rows.append(row)
    status = row.get("error") or (f"skipped: {row['skipped']}" if "skipped" in row else "ok")
    print(f"[{clock.budget_s - clock.left():6.0f} s] {leg} {case}: {status}", file=sys.stderr, flush=True)
    return row


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up: kernels chosen, pools filled
    return 1e3 * median([timed(fn, device) for _ in range(repeats)])


# -- the reference model -----------------------------------------------------------------------
def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """transformers' model from the same folder, sdpa attention, straight onto the device."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # no CPU copy of the weights first
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs).to(device).eval()


# -- rows --------------------------------------------------------------------------------------
def release_all(outs) -> None:
    for out in outs:
        out.cache.release()


def logits_row(model: Decoder, hf, device: torch.device) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (SHORT,), generator=torch.Generator().manual_seed(7))
    ours, cache = model.prefill(ids)
    cache.release()
    with torch.inference_mode():
        ref = hf(ids.to(device)[None], logits_to_keep=1).logits[0, -1].float()
    top_ours, top_ref = ours.topk(10).indices.tolist(), ref.topk(10).indices.tolist()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=0).item()
    return {"tokens": SHORT, "cosine": cosine, "same_top1": top_ours[0] == top_ref[0],
            "top10_overlap": len(set(top_ours) & set(top_ref)) / 10,
            "max_abs_diff": (ours - ref).abs().max().item(), "passed": cosine >= COSINE_BAR}


def prefill_row(model: Decoder, hf, flat: list[int], device: torch.device) -> dict:
    ids = torch.tensor(flat, device=device)
    engine = median_ms(lambda: model.prefill(ids)[1].release(), device)
    with torch.inference_mode():
        ref = median_ms(lambda: hf(ids[None], logits_to_keep=1), device)
    return {"tokens": len(flat), "engine_ms": engine, "hf_ms": ref, "hf_over_engine": ref / engine}


def direct_row(runner: BatchRunner, req, plan, full_ms: float | None, device: torch.device) -> dict:
    ms = median_ms(lambda: release_all(runner.run([req], plan)), device)
    return {"ms": ms, "full_prefill_ms": full_ms, "ratio": ms / full_ms if full_ms else None}


def stage_store(model: Decoder, req) -> tuple:
    """The request's chunks put in a memory-tier store (sized to hold them), the transfer engine
    over it and the keyed request: what serving stages a batch from."""
    from cachesmith.kvstore import ChunkStore, KeyedRequest, StoreConfig, TransferEngine

    num_bytes = sum(c.keys.numel() + c.values.numel() for c in req.chunks) * req.chunks[0].keys.element_size()
    store = ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=2 * num_bytes + (64 << 20)))
    keyed = KeyedRequest([store.put(c) for c in req.chunks], list(req.suffix_ids))
    return store, TransferEngine(store, model), keyed, num_bytes


def store_row(runner: BatchRunner, engine, keyed, req, plan, full_ms: float | None, device: torch.device) -> dict:
    """`plan` staged from the store, and its logits against the direct path's (the store->device
    copy must change nothing)."""
    def run():
        with engine.stage([keyed], plan) as staged:
            outs = runner.run(staged.requests, plan, staged)
            logits = outs[0].logits.clone()
        release_all(outs)
        return logits
    direct = runner.run([req], plan)
    diff = (run() - direct[0].logits).abs().max().item()
    release_all(direct)
    ms = median_ms(run, device)
    return {"ms": ms, "full_prefill_ms": full_ms, "ratio": ms / full_ms if full_ms else None,
            "logit_diff_vs_direct": diff}


def method_rows(rows, clock, reserve_s, model, runner, req, context: int, full_ms, device) -> None:
    """Each method at one context: direct, then through the store (set up once for all four)."""
    staged: dict = {}

    def setup():
        start = time.perf_counter()
        staged["store"], staged["engine"], staged["keyed"], num_bytes = stage_store(model, req)
        return {"context_tokens": context, "stored_gb": num_bytes / 1e9, "put_s": time.perf_counter() - start}
    guarded(rows, clock, "setup", f"store {context}", setup, reserve_s)
    try:
        for name, plan in METHODS.items():
            common = {"context_tokens": context, "method": name}
            guarded(rows, clock, "reuse", f"{name} {context} direct",
                    lambda: {**common, "path": "direct", **direct_row(runner, req, plan, full_ms, device)}, reserve_s)
            guarded(rows, clock, "reuse", f"{name} {context} store",
                    lambda: {**common, "path": "store", **(store_row(runner, staged["engine"], staged["keyed"], req,
                             plan, full_ms, device) if "keyed" in staged else {"skipped": "the store's setup failed"})},
                    reserve_s)
    finally:
        if "engine" in staged:
            staged["engine"].close()
            staged["store"].close()


def context_rows(rows, clock, reserve_s, model, hf, runner, context: int, device) -> None:
    """At one context: the request (chunk KV computed off the clock), the prefill row, the methods."""
    made: dict = {}

    def make():
        made["req"], made["flat"] = random_request(model, [], context, random.Random(context))
        return {"context_tokens": context, "num_chunks": len(made["req"].chunks)}
    guarded(rows, clock, "setup", f"request {context}", make, reserve_s)
    if "req" not in made:
        return
    req, flat = made["req"], made["flat"]
    pre = guarded(rows, clock, "prefill", f"{context}", lambda: prefill_row(model, hf, flat, device), reserve_s)
    method_rows(rows, clock, reserve_s, model, runner, req, context, pre.get("engine_ms"), device)


def batch_row(model: Decoder, hf, runner: BatchRunner, device: torch.device) -> dict:
    made = [random_request(model, [], SHORT, random.Random(100 + i)) for i in range(BATCH)]
    reqs, ids = [r for r, _ in made], torch.tensor([f for _, f in made], device=device)
    blend = median_ms(lambda: release_all(runner.run(reqs, cacheblend(0.15))), device)
    full = median_ms(lambda: release_all(runner.run(reqs, full_prefill(model.num_layers))), device)
    with torch.inference_mode():
        ref = median_ms(lambda: hf(ids, logits_to_keep=1), device)
    return {"batch_size": BATCH, "context_tokens": SHORT, "tokens_each": ids.shape[1], "cacheblend_ms": blend,
            "engine_full_ms": full, "hf_ms": ref, "hf_over_cacheblend": ref / blend, "hf_over_engine_full": ref / full}


def engine_decode_s(model: Decoder, ids: torch.Tensor, streams: int, device: torch.device) -> float:
    """Seconds for `streams` sequences to take NEW_TOKENS greedy tokens each over copies of one
    prefilled 2K cache (the first token comes from the prefill's logits: NEW_TOKENS - 1 steps)."""
    logits, base = model.prefill(ids, extra_capacity=NEW_TOKENS + 4)

    def once() -> float:
        caches = [base.clone() for _ in range(streams)]  # copies made off the clock

        def run():
            decoding = Decoding(model)
            for cache in caches:
                decoding.start(logits, cache, NEW_TOKENS, eos_token_ids=())
            decoding.run()
        seconds = timed(run, device)
        for cache in caches:
            cache.release()
        return seconds
    once()
    seconds = median([once() for _ in range(3)])
    base.release()
    return seconds


def hf_decode_s(hf, ids: torch.Tensor, streams: int, device: torch.device) -> float:
    """transformers' generate of NEW_TOKENS less that of 1 token (its prefill and first token)."""
    x = ids.to(device)[None].repeat(streams, 1)

    def generate(n: int):
        return lambda: hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        return (median_ms(generate(NEW_TOKENS), device) - median_ms(generate(1), device)) / 1e3


def decode_row(model: Decoder, hf, streams: int, device: torch.device) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (SHORT,), generator=torch.Generator().manual_seed(11))
    steps = streams * (NEW_TOKENS - 1)
    ours, ref = steps / engine_decode_s(model, ids, streams, device), steps / hf_decode_s(hf, ids, streams, device)
    return {"context_tokens": SHORT, "streams": streams, "new_tokens": NEW_TOKENS, "engine_tokens_per_s": ours,
            "hf_tokens_per_s": ref, "engine_over_hf": ours / ref}


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
    guarded(rows, clock, "logits", f"{SHORT}", lambda: logits_row(model, hf, device), reserve_s)
    for context in args.contexts:
        context_rows(rows, clock, reserve_s, model, hf, runner, context, device)
    guarded(rows, clock, "batch", f"{BATCH}x{SHORT} cacheblend@0.15", lambda: batch_row(model, hf, runner, device),
            reserve_s)
    for streams in STREAMS:
        guarded(rows, clock, "decode", f"{streams} stream(s) {SHORT}",
                lambda: decode_row(model, hf, streams, device), reserve_s)
    del model, hf, runner, loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the server gets the device to itself


# -- the run -----------------------------------------------------------------------------------
def bars(rows: list[dict], skip_serve: bool) -> list[dict]:
    logits = next((r for r in rows if r["leg"] == "logits"), {})
    serve = next((r for r in rows if r["leg"] == "serve"), {})
    errored = [f"{r['leg']} {r['case']}" for r in rows if "error" in r]
    out = [{"bar": f"logits cosine >= {COSINE_BAR}", "value": logits.get("cosine"),
            "passed": bool(logits.get("passed"))},
           {"bar": f"{NUM_RAG}/{NUM_RAG} RAG requests answered with a plan",
            "value": serve.get("answered_with_plan", "skipped: " + serve["skipped"] if "skipped" in serve else None),
            "passed": bool(serve.get("passed"))},
           {"bar": "no row errored", "value": errored, "passed": not errored}]
    return out[:1] + out[2:] if skip_serve else out


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
             "serve": (_fmt(r.get("answered_with_plan"), f"/{NUM_RAG} planned"),
                       _fmt((r.get("chat") or {}).get("status"), label="chat "), _fmt(r.get("startup_s"), " s up"))}
    ours, ref, ratio = shown.get(row["leg"], ("", "", ""))
    status = ("error: " + r["error"][:80]) if "error" in r else ("skipped: " + r["skipped"]) if "skipped" in r else \
        ("FAIL" if r.get("passed") is False else "ok")
    return {"leg": row["leg"], "case": r["case"], "ours": ours, "reference": ref, "ratio": ratio, "status": status}


def versions(device: torch.device) -> dict:
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="default: the packaged smollm2-135m folder")
    ap.add_argument("--doc-words", type=int, default=150, help="words per served document")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="rows that would start later are skipped")
    ap.add_argument("--json", action="store_true", help="print only the JSON payload")
    ap.add_argument("--out", default="docs/bench/gpu_check.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    return args


def main() -> int:
    args = parse_args()
    clock, rows = Clock(args.max_minutes), []
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    payload = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "contexts": args.contexts,
               "versions": versions(device), "tokenizer_dir": str(args.tokenizer_dir)}
    root = scratch_root(weight_bytes(llama_config(args.shape, args.tokenizer_dir), dtype))
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
    payload["rows"], payload["bars"] = rows, bars(rows, args.skip_serve)
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
