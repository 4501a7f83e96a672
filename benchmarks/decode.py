"""Decode throughput of the serving path on the packaged model: many sequences stepped together.

For 1, 4, 8 and 16 concurrent decoding sequences at 1K and 4K context tokens, float32 and bfloat16,
each sequence over its own KV cache (filled by a full prefill, the same context copied into each):
- `tokens_per_s`: tokens produced per second by `model.decode.decode_step` (what `Decoding.step`
  and the server's decode thread run), the median step over `--steps` steps after a warm-up, over
  caches moved to the head-major layout as `Decoding` moves them (`--token-major`: left as staged);
- `reference_tokens_per_s` (1 stream only): the one-sequence reference `Decoder.decode_step`;
- `weights_floor_s` (per dtype), measured in the same run: one pass over every weight matrix through
  the same linear kernels with one row, i.e. the memory traffic a decode step cannot avoid;
  `floor_fraction` = weights_floor_s / step time of one stream;
- `kernels`: where one stream's step ran, as measured at load (`native layers`: every layer in one
  call to `model.native`'s kernels, compiled for this CPU; else which kernel the matmuls and the
  attention went to: `native`, or torch's `packed`/`plain`/`torch`);
- with `--torch-kernels` (1 stream only): `torch_kernels_tokens_per_s`, the same step with torch's
  kernels only (oneDNN / `F.linear` and the flash kernel), right after our row: the A/B of the
  native kernels in the same run;
- with `--llama-cpp` (1 stream only): `llama_cpp_tokens_per_s`, llama.cpp's `llama-bench` on the
  same weights, dtype, depth and thread count, run right after our row (`benchmarks/llama_cpp.py`
  builds it from its PyPI source distribution on first use), and `vs_llama_cpp`, our rate over it.
`--json` prints the rows; `--out` writes them. Targets: one stream at least llama.cpp's
rate (>= 45 tokens/s in float32 and >= 80 in bfloat16 at 1K on 2 cores); 8 streams >= 4x one
stream's tokens/s.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from tqdm import tqdm

from benchmarks import llama_cpp
from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, parse_timing_args, timed

from cachesmith.model import Decoder, resolve_model
from cachesmith.model.decode import is_fused, decode_step

STREAMS = (1, 4, 8, 16)


def weights_floor_s(model: Decoder, repeats: int = 5) -> float:
    """One row through every weight matrix (the bytes a decode step must read), median seconds."""
    cfg = model.config
    x = torch.randn(1, cfg.hidden_size, dtype=model.dtype, device=model.device)
    wide = torch.randn(1, cfg.intermediate_size, dtype=model.dtype, device=model.device)
    attn = torch.randn(1, cfg.num_heads * cfg.head_dim, dtype=model.dtype, device=model.device)

    def one_pass():
        for layer in model.layers:
            layer.qkv_proj(x), layer.o_proj(attn), layer.gate_up_proj(x), layer.down_proj(wide)
        model.head_proj(x)
    one_pass()
    return median([timed(one_pass, model.device) for _ in range(repeats)])


@contextlib.contextmanager
def torch_kernels(model: Decoder):
    """Decode through torch's kernels only (what loading chose is restored after)."""
    saved = model.native_rows, model.is_native_attention
    model.use_native(0, False)
    try:
        yield
    finally:
        model.use_native(*saved)


def kernels(model: Decoder) -> str:
    """Where one stream's step runs, as loading measured it."""
    if is_fused(model, 1):
        return "native layers"
    return f"{model.one_row_kernel} matmul, {'native' if model.is_native_attention else 'torch'} attention"


def _caches(model: Decoder, context: int, streams: int, room: int):
    ids = torch.randint(100, model.config.vocab_size - 100, (context,), generator=torch.Generator().manual_seed(0))
    _, base = model.prefill(ids, extra_capacity=room)
    caches = [base]
    for _ in range(streams - 1):
        cache = model.new_cache(context + room)
        cache.key_slab[:, :context] = base.key_slab[:, :context]
        cache.value_slab[:, :context] = base.value_slab[:, :context]
        cache.num_tokens = context
        caches.append(cache)
    return caches


def step_s(model: Decoder, context: int, streams: int, steps: int, is_reference: bool = False,
           is_head_major: bool = True) -> float:
    caches = _caches(model, context, streams, room=steps + 4)
    if is_head_major and not is_reference:  # as `Decoding` moves a cache before its first step
        for cache in caches:
            cache.to_head_major()
    if is_reference:
        run = lambda: model.decode_step(5, caches[0])  # noqa: E731
    else:
        run = lambda: decode_step(model, [5] * streams, caches)  # noqa: E731
    for _ in range(2):
        run()
    seconds = median([timed(run, model.device) for _ in range(steps)])
    for cache in caches:
        cache.release()
    return seconds


def _add_llama_cpp(row: dict, args) -> None:
    """llama.cpp's rate beside a one-stream row; if it cannot be built or run, say so once and go on."""
    try:
        row["llama_cpp_tokens_per_s"] = llama_cpp.tokens_per_s(row["dtype"], row["context_tokens"],
                                                               torch.get_num_threads())
    except llama_cpp.LlamaCppError as exc:
        print(f"llama.cpp rows skipped: {exc}", file=sys.stderr)
        args.llama_cpp = False
        return
    row["vs_llama_cpp"] = row["tokens_per_s"] / row["llama_cpp_tokens_per_s"]


def measure(args) -> list[dict]:
    rows = []
    for dtype in args.dtypes:
        model = Decoder(resolve_model(args.model), args.device, dtype)
        floor = weights_floor_s(model)
        todo = [(c, s) for c in args.contexts for s in args.streams]
        for context, streams in tqdm(todo, desc=f"decode {dtype}", unit="shape", file=sys.stderr):
            seconds = step_s(model, context, streams, args.steps, is_head_major=not args.token_major)
            row = {"dtype": dtype, "context_tokens": context, "streams": streams, "step_s": seconds,
                   "tokens_per_s": streams / seconds, "weights_floor_s": floor, "kernels": kernels(model)}
            if streams == 1:
                row["reference_tokens_per_s"] = 1 / step_s(model, context, 1, args.steps, is_reference=True)
                row["floor_fraction"] = floor / seconds
                if args.torch_kernels:
                    with torch_kernels(model):
                        row["torch_kernels_tokens_per_s"] = 1 / step_s(model, context, 1, args.steps)
                if args.llama_cpp:
                    _add_llama_cpp(row, args)
            rows.append(row)
        one = {r["context_tokens"]: r["tokens_per_s"] for r in rows if r["dtype"] == dtype and r["streams"] == 1}
        for r in rows:
            if r["dtype"] == dtype and r["context_tokens"] in one:
                r["speedup_vs_one"] = r["tokens_per_s"] / one[r["context_tokens"]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--streams", nargs="+", type=int, default=list(STREAMS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per shape (median)")
    ap.add_argument("--token-major", action="store_true",
                    help="decode over caches left in the staging layout (the A/B of `KVCache.to_head_major`)")
    ap.add_argument("--torch-kernels", action="store_true",
                    help="also time one stream on torch's kernels only (the A/B of the native kernels)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also run llama.cpp's llama-bench on the same weights (built on first use)")
    args = parse_timing_args(ap)
    rows = measure(args)
    cols = ["dtype", "context_tokens", "streams", "tokens_per_s", "speedup_vs_one", "reference_tokens_per_s",
            "floor_fraction"]
    if any("torch_kernels_tokens_per_s" in r for r in rows):
        cols += ["torch_kernels_tokens_per_s"]
    if any("vs_llama_cpp" in r for r in rows):
        cols += ["llama_cpp_tokens_per_s", "vs_llama_cpp"]
    emit(rows, args.json, args.out,
         lambda: print_table([{c: r.get(c, "") for c in cols} for r in rows], cols))


if __name__ == "__main__":
    main()
