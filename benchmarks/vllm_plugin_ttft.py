"""TTFT of vLLM with the cachesmith plugin against vLLM alone, in one vLLM server, one run.

vLLM's CPU build (`benchmarks/vllm_server.py`) serves the packaged model in float32 with the plugin
loaded (`cachesmith.integrations.vllm_connector`) and prefix caching off, so a request without
`kv_transfer_params` is vLLM alone. Per context size (`--sizes`) and document set (`--repeats`):
- `first_sight`: the documents through the plugin, new to its store (chunks prefilled and stored);
- `shuffled`: the same documents in reverse order, through vLLM alone and through the plugin,
  once per method (`--methods`: fixed ones, and `cachesmith`, planned under `--slo-ms`).
TTFT is the latency of a one-token completion, sent one at a time. Writes
`{"rows": [{"server", "case", "context_tokens", "ttft_s", "plans"}]}` with the median over the
sets (`plans`: the plans the plugin reported running), and `ratio_shuffled`: plugin over vLLM
alone per method and size (`--out`).

`--device cuda`: the same cases on a GPU, on a random-weight model of `--shape` (default `8b`,
Llama-3-8B's layers; `benchmarks/common/random_model.py`, with the packaged tokenizer) in `--dtype`
(default bfloat16), at 2K and 8K tokens, served by a vLLM CUDA build the user installed
(`--vllm-python`: its Python; vLLM's CUDA wheels come from PyPI's `vllm` with the torch it pins,
and cachesmith must import there, see docs/vllm.md). vLLM takes `GPU_MEMORY_UTILIZATION` of the
GPU; the connector's decoder holds its own copy of the weights in the rest. Written to
docs/bench/vllm_plugin_ttft_cuda.json by default, with the shape and the device's name.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common.payload import emit, print_table
from benchmarks.common.server_process import stop_on_sigterm
from benchmarks.vllm_anchor import QUESTION, document_sets
from benchmarks.vllm_server import VllmServer, plugin_args

from cachesmith.model.assets import DEFAULT_MODEL, resolve_model
from cachesmith.model.tokenizer import Tokenizer


def one_token_s(url: str, tok: Tokenizer, name: str, docs: list[str], method: str | None,
                slo_ms: float) -> tuple[float, str]:
    """(TTFT of a one-token completion, the plan the plugin reported, or "" for vLLM alone)."""
    parts = tok.rag_prompt_parts(docs, QUESTION)
    body = {"model": name, "prompt": parts.token_ids, "max_tokens": 1, "temperature": 0.0}
    if method is not None:
        body["kv_transfer_params"] = {"cachesmith": {"num_prefix_tokens": len(parts.prefix_ids), "method": method,
                                                     "chunk_token_counts": [len(c) for c in parts.chunk_ids],
                                                     "slo_ms": slo_ms}}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    report = (r.json().get("kv_transfer_params") or {}).get("cachesmith", {})
    if "error" in report:
        raise RuntimeError(f"the plugin did not build {method}'s KV: {report['error']}")
    return elapsed, report.get("plan", "")


def cases(docs: list[str], methods: list[str]):
    """(server, case, documents, method) in the order they run: first sight, then shuffled."""
    yield f"vllm + cachesmith {methods[0]}", "first_sight", docs, methods[0]
    yield "vllm", "shuffled", docs[::-1], None
    for method in methods:
        yield f"vllm + cachesmith {method}", "shuffled", docs[::-1], method


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", nargs="+", type=int, default=None, help="default: 2048 (cpu), 2048 8192 (cuda)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["cacheblend@0.15", "cachesmith"])
    ap.add_argument("--slo-ms", type=float, default=2000.0, help="the planned method's TTFT SLO")
    ap.add_argument("--shape", default="8b", help="cuda: the random model's shape (benchmarks/common/random_model.py)")
    ap.add_argument("--dtype", default=None, help="default: float32 (cpu), bfloat16 (cuda)")
    ap.add_argument("--vllm-python", type=Path, default=None, help="cuda: the Python of a vLLM CUDA build")
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="cuda: default the packaged model's folder")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="default: docs/bench/vllm_plugin_ttft[_cuda].json")
    args = ap.parse_args()
    is_cuda = args.device == "cuda"
    if is_cuda and args.vllm_python is None:  # before building the model: it takes minutes
        ap.error("--device cuda needs --vllm-python: the Python of a vLLM CUDA build (docs/vllm.md)")
    args.sizes = args.sizes or ([2048, 8192] if is_cuda else [2048])
    args.dtype = args.dtype or ("bfloat16" if is_cuda else "float32")
    args.out = args.out or f"docs/bench/vllm_plugin_ttft{'_cuda' if is_cuda else ''}.json"
    return args


def served_model(args, work: Path) -> tuple[Path, str, dict]:
    """(model folder, served name, how it was made): the packaged model on the CPU, a random one
    of `--shape` on a GPU."""
    if args.device == "cpu":
        return resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, {"model": DEFAULT_MODEL}
    import torch
    from benchmarks.common.random_model import build_model, default_tokenizer_dir

    from cachesmith.model.decoder import resolve_dtype

    args.tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    model_dir, info = build_model(args, work, torch.device("cuda:0"), resolve_dtype(args.dtype))
    return model_dir, f"random-{args.shape}", {"model": f"random-{args.shape}", **info}


def measure(server, tok: Tokenizer, name: str, args) -> tuple[list[dict], dict]:
    rows, ratios, start = [], {}, 0
    one_token_s(server.url, tok, name, ["warm-up"], None, args.slo_ms)
    for size in args.sizes:
        sets, start = document_sets(tok, size, args.repeats, start)
        times: dict[tuple[str, str], list[tuple[float, str]]] = {}
        for docs in sets:
            for server_name, case, order, method in cases(docs, args.methods):
                times.setdefault((server_name, case), []).append(
                    one_token_s(server.url, tok, name, order, method, args.slo_ms))
        for (server_name, case), runs in times.items():
            rows.append({"server": server_name, "case": case, "context_tokens": size,
                         "ttft_s": statistics.median(t for t, _ in runs), "ttft_all_s": [t for t, _ in runs],
                         "plans": sorted({plan for _, plan in runs if plan})})
        alone = statistics.median(t for t, _ in times[("vllm", "shuffled")])
        for method in args.methods:
            plugin = statistics.median(t for t, _ in times[(f"vllm + cachesmith {method}", "shuffled")])
            ratios.setdefault(method, {})[size] = plugin / alone
    return rows, ratios


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="vllm-plugin-") as work:
        model_dir, name, setup = served_model(args, Path(work))
        tok = Tokenizer(model_dir)
        server = VllmServer(model_dir, name, max_model_len=max(args.sizes) + 1024, device=args.device,
                            dtype=args.dtype, vllm_python=args.vllm_python,
                            extra_args=plugin_args(str(model_dir) if args.device == "cuda" else name))
        with server:
            rows, ratios = measure(server, tok, name, args)
    payload = {"rows": rows, "ratio_shuffled": ratios, "methods": args.methods, "slo_ms": args.slo_ms,
               "device": args.device, "dtype": args.dtype, "setup": setup}
    emit(payload, args.json, args.out, lambda: (
        print_table(rows, ["server", "case", "context_tokens", "ttft_s", "plans"]),
        print("shuffled, plugin / vLLM alone:",
              {m: {k: round(v, 3) for k, v in by.items()} for m, by in ratios.items()})))


if __name__ == "__main__":
    main()
