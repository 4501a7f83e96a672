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
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, print_table  # noqa: E402
from vllm_anchor import QUESTION, document_sets  # noqa: E402
from server_process import stop_on_sigterm  # noqa: E402
from vllm_server import VllmServer  # noqa: E402

from cachesmith.model.assets import DEFAULT_MODEL, resolve_model  # noqa: E402
from cachesmith.model.tokenizer import Tokenizer  # noqa: E402

CONNECTOR = json.dumps({"kv_connector": "CachesmithConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "cachesmith.integrations.vllm_connector",
                        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"model": DEFAULT_MODEL}})


def one_token_s(url: str, tok: Tokenizer, docs: list[str], method: str | None, slo_ms: float) -> tuple[float, str]:
    """(TTFT of a one-token completion, the plan the plugin reported, or "" for vLLM alone)."""
    parts = tok.rag_prompt_parts(docs, QUESTION)
    body = {"model": DEFAULT_MODEL, "prompt": parts.token_ids, "max_tokens": 1, "temperature": 0.0}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["cacheblend@0.15", "cachesmith"])
    ap.add_argument("--slo-ms", type=float, default=2000.0, help="the planned method's TTFT SLO")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/vllm_plugin_ttft.json")
    args = ap.parse_args()
    stop_on_sigterm()
    tok = Tokenizer(resolve_model(DEFAULT_MODEL))
    rows, ratios, start = [], {}, 0
    with VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL,
                    extra_args=("--no-enable-prefix-caching", "--kv-transfer-config", CONNECTOR)) as server:
        one_token_s(server.url, tok, ["warm-up"], None, args.slo_ms)
        for size in args.sizes:
            sets, start = document_sets(tok, size, args.repeats, start)
            times: dict[tuple[str, str], list[tuple[float, str]]] = {}
            for docs in sets:
                for server_name, case, order, method in cases(docs, args.methods):
                    times.setdefault((server_name, case), []).append(
                        one_token_s(server.url, tok, order, method, args.slo_ms))
            for (server_name, case), runs in times.items():
                rows.append({"server": server_name, "case": case, "context_tokens": size,
                             "ttft_s": statistics.median(t for t, _ in runs), "ttft_all_s": [t for t, _ in runs],
                             "plans": sorted({plan for _, plan in runs if plan})})
            alone = statistics.median(t for t, _ in times[("vllm", "shuffled")])
            for method in args.methods:
                plugin = statistics.median(t for t, _ in times[(f"vllm + cachesmith {method}", "shuffled")])
                ratios.setdefault(method, {})[size] = plugin / alone
    payload = {"rows": rows, "ratio_shuffled": ratios, "methods": args.methods, "slo_ms": args.slo_ms}
    emit(payload, args.json, args.out, lambda: (
        print_table(rows, ["server", "case", "context_tokens", "ttft_s", "plans"]),
        print("shuffled, plugin / vLLM alone:",
              {m: {k: round(v, 3) for k, v in by.items()} for m, by in ratios.items()})))


if __name__ == "__main__":
    main()
