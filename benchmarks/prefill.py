"""Our full prefill vs transformers' forward (sdpa) on the packaged model.

Rows: tokens, dtype, ours_s, hf_s (median of --repeats, interleaved), ratio = hf_s / ours_s, and
max_abs_logit_diff of the last position. Usage: python benchmarks/prefill.py [--json] [--out F]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, median, print_table, timed  # noqa: E402

from cachesmith.model import Decoder, resolve_model  # noqa: E402


def run(sizes: list[int], dtypes: list[str], repeats: int, model_name: str, device: str) -> list[dict]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(model_name)
    rows = []
    for dtype in dtypes:
        ours = Decoder(path, device, dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=ours.dtype, attn_implementation="sdpa")
        hf = hf.to(ours.device).eval()
        for n in sizes:
            ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            ids = ids.to(ours.device)
            with torch.inference_mode():
                ours_logits, _ = ours.prefill(ids)
                hf_logits = hf(ids[None], logits_to_keep=1).logits[0, -1].float()
                ours_t, hf_t = [], []
                for _ in range(repeats):  # interleaved so drift on a shared machine hits both
                    ours_t.append(timed(lambda: ours.prefill(ids), ours.device))
                    hf_t.append(timed(lambda: hf(ids[None], logits_to_keep=1), ours.device))
            row = {"tokens": n, "dtype": dtype, "ours_s": median(ours_t), "hf_s": median(hf_t),
                   "max_abs_logit_diff": (ours_logits - hf_logits).abs().max().item()}
            row["ratio"] = row["hf_s"] / row["ours_s"]
            rows.append(row)
            print(f"  {dtype} {n}: ours {row['ours_s']:.3f}s hf {row['hf_s']:.3f}s", file=sys.stderr)
        del hf, ours
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print only the JSON rows")
    ap.add_argument("--out", default="results/prefill.json")
    args = ap.parse_args()
    rows = run(args.sizes, args.dtypes, args.repeats, args.model, args.device)
    emit(rows, args.json, args.out, lambda: print_table(
        rows, ["tokens", "dtype", "ours_s", "hf_s", "ratio", "max_abs_logit_diff"]))


if __name__ == "__main__":
    main()
