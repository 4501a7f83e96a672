"""Full prefill on the packaged model: speed against the machine's matmul peak, the serving path and
transformers' forward (sdpa).

Per (tokens, dtype), timed interleaved (median of --repeats; drift on a shared machine hits every
side alike):
  ours_s      `Decoder.prefill` (the plain decoder forward, reference full computation)
  runner_s    the serving path: `BatchRunner.run` with `preset("full_prefill", 0, L)` on the same
              tokens (prefix-free, chunks of 256-512 tokens and a 32-token suffix, chunk KV
              precomputed off the clock); runner_ratio = ours_s / runner_s (>= 1: as fast)
  hf_s        transformers' forward (logits of the last position); ratio = hf_s / ours_s
  peak        a --peak-size square torch.mm in the same dtype, in the same loop
gflop counts the linear layers on every token (2 * parameters of QKV, O, gate, up, down), the LM
head on one row, and causal attention 2 * 2 * S(S+1)/2 * H * D per layer; gflops = gflop / time and
peak_fraction = gflops / peak_gflops (best_peak_fraction: the same from the fastest repeat of each
side). max_abs_logit_diff: ours vs HF (last position); runner_logit_diff: runner vs ours.
load_1m: the machine's 1-minute load average after the row (others' work on a shared machine
stalls the many small parallel kernels of a prefill more than one large matmul).
Usage: python -m benchmarks.prefill [--sizes 2048] [--no-hf] [--json] [--out F]
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, timed

from cachesmith.calibration.synthetic import random_request
from cachesmith.model import Decoder, ModelConfig, resolve_model
from cachesmith.recompute import BatchRunner, preset


def prefill_flop(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of a full causal prefill of `tokens` tokens (last-position logits only)."""
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = hidden * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    params = qkv + cfg.num_heads * d * hidden + 3 * hidden * inter  # QKV, O, gate, up, down
    linear = 2 * params * tokens * cfg.num_layers
    attention = 2 * 2 * tokens * (tokens + 1) / 2 * cfg.num_heads * d * cfg.num_layers
    return linear + attention + 2 * hidden * cfg.vocab_size


def _release(cache) -> None:
    release = getattr(cache, "release", None)  # pooled caches hand their slabs back
    if release is not None:
        release()


def run(sizes: list[int], dtypes: list[str], repeats: int, model_name: str, device: str,
        with_hf: bool = True, peak_size: int = 2048) -> list[dict]:
    path = resolve_model(model_name)
    rows = []
    for dtype in dtypes:
        ours = Decoder(path, device, dtype)
        runner, plan = BatchRunner(ours), preset("full_prefill", 0.0, ours.num_layers)
        hf = None
        if with_hf:
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=ours.dtype, attn_implementation="sdpa")
            hf = hf.to(ours.device).eval()
        g = torch.Generator().manual_seed(0)
        a = torch.randn(peak_size, peak_size, generator=g).to(ours.device, ours.dtype)
        b = torch.randn(peak_size, peak_size, generator=g).to(ours.device, ours.dtype)
        for n in sizes:
            req, flat = random_request(ours, [], n - 32, random.Random(n))  # chunk KV: off the clock
            ids = torch.tensor(flat, device=ours.device)

            def decoder():
                logits, cache = ours.prefill(ids)
                _release(cache)
                return logits

            def serving():
                out = runner.run([req], plan)[0]
                _release(out.cache)
                return out.logits

            with torch.inference_mode():
                ours_logits, runner_logits = decoder(), serving()  # also warm-up
                hf_logits = hf(ids[None], logits_to_keep=1).logits[0, -1].float() if hf is not None else None
                torch.mm(a, b)
                t = {"ours": [], "runner": [], "hf": [], "peak": []}
                for _ in range(repeats):  # interleaved so drift on a shared machine hits all
                    t["ours"].append(timed(decoder, ours.device))
                    t["runner"].append(timed(serving, ours.device))
                    if hf is not None:
                        t["hf"].append(timed(lambda: hf(ids[None], logits_to_keep=1), ours.device))
                    t["peak"].append(timed(lambda: torch.mm(a, b), ours.device))
            flop = prefill_flop(ours.config, n)
            peak = 2 * peak_size ** 3 / median(t["peak"]) / 1e9
            row = {"tokens": n, "dtype": dtype, "gflop": flop / 1e9, "peak_gflops": peak,
                   "ours_s": median(t["ours"]), "runner_s": median(t["runner"]),
                   "runner_logit_diff": (runner_logits - ours_logits).abs().max().item()}
            row["gflops"] = row["gflop"] / row["ours_s"]
            row["peak_fraction"] = row["gflops"] / peak
            row["runner_peak_fraction"] = row["gflop"] / row["runner_s"] / peak
            row["runner_ratio"] = row["ours_s"] / row["runner_s"]
            row["best_peak_fraction"] = flop / min(t["ours"]) / (2 * peak_size ** 3 / min(t["peak"]))
            row["load_1m"] = os.getloadavg()[0]
            if hf is not None:
                row["hf_s"] = median(t["hf"])
                row["ratio"] = row["hf_s"] / row["ours_s"]
                row["max_abs_logit_diff"] = (ours_logits - hf_logits).abs().max().item()
            rows.append(row)
            print(f"  {dtype} {n}: ours {row['ours_s']:.3f}s ({row['peak_fraction']:.2f} of "
                  f"{peak:.0f} GFLOP/s) runner {row['runner_s']:.3f}s"
                  + (f" hf {row['hf_s']:.3f}s" if hf is not None else ""), file=sys.stderr)
        del hf, ours, runner
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peak-size", type=int, default=2048, help="side of the torch.mm peak reference")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' forward")
    ap.add_argument("--json", action="store_true", help="print only the JSON rows")
    ap.add_argument("--out", default="results/prefill.json")
    args = ap.parse_args()
    rows = run(args.sizes, args.dtypes, args.repeats, args.model, args.device, not args.no_hf, args.peak_size)
    cols = ["tokens", "dtype", "gflop", "ours_s", "gflops", "peak_gflops", "peak_fraction", "runner_s",
            "runner_ratio", "runner_peak_fraction", "runner_logit_diff", "best_peak_fraction", "load_1m"]
    if not args.no_hf:
        cols += ["hf_s", "ratio", "max_abs_logit_diff"]
    emit({"rows": rows}, args.json, args.out, lambda: print_table(rows, cols))


if __name__ == "__main__":
    main()
