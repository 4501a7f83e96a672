"""A bounded load run of the HTTP server on loopback, next to the same trace on the replay clock.

One MIX trace (Poisson arrivals at a target utilization of full prefill, SLO = scale x the base
SLO measured here, ~100 requests) is served twice with the same method and profile:
  - `replay`: the engine on the replay clock (as `cachesmith bench`: batch TTFTs measured,
    decode off the clock);
  - `live`: a real uvicorn server on 127.0.0.1, the client sending each request at its arrival
    time as a streaming chat completion (documents as texts, gold for the gate). The client times
    TTFT to the first SSE event; the server reports its own TTFT in the final chunk. The client
    gates the streamed answer against the instance as the replay does (the server knows task and
    gold but not workload metadata, such as the VT kv-split variant's item pattern).
Chunk KV of every document is stored before both runs (both see a warm store). Rows: replay,
live (server clock), live (client clock) with QSA, TTFT attainment, gate rate and TTFT P50/P90/P99.
`--json` prints the payload; `--out FILE` writes it.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx
from tqdm import tqdm

from benchmarks.common.payload import emit, print_table
from benchmarks.common.sse import Stream

from cachesmith.bench.metrics import summarize
from cachesmith.bench.run import measure_base, reuse_factor, reuse_probes
from cachesmith.bench.setting import BenchConfig, build_requests, instances
from cachesmith.engine import Engine, EngineConfig, EngineStats
from cachesmith.gates import make_gate
from cachesmith.instance import WorkloadInstance
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.calibration.packaged import find_profile, rescaled
from cachesmith.calibration.shadow import shadow_calibrator
from cachesmith.request import Request
from cachesmith.scheduler import SchedulerConfig
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.run import BackgroundServer

GATE = make_gate("task")

COLUMNS = ["run", "num_requests", "qsa", "ttft_attainment", "gate_rate", "ttft_p50_s", "ttft_p90_s",
           "ttft_p99_s", "throughput_rps", "recompute_fraction", "mean_batch_size", "num_errors"]


def chat_body(req: Request, inst: WorkloadInstance, model: str) -> dict:
    messages = ([{"role": "system", "content": inst.prefix}] if inst.prefix else []) + [
        {"role": "user", "content": inst.question}]
    if inst.answer_prefix:
        messages.append({"role": "assistant", "content": inst.answer_prefix})
    return {"model": model, "messages": messages, "documents": list(inst.documents), "stream": True,
            "max_tokens": inst.max_new_tokens, "slo_ms": 1e3 * req.slo_s, "gold": list(inst.gold),
            "task": inst.task}


async def one(client: httpx.AsyncClient, req: Request, inst: WorkloadInstance, model: str, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    stream, error = Stream("event"), None  # TTFT to the first SSE event, an error event too
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(req, inst, model)) as r:
        if r.status_code != 200:
            error = (await r.aread()).decode()[:200]
        await stream.read(r.aiter_lines())
    error = stream.errors[-1]["message"] if stream.errors else error
    final = stream.final
    record = {"request_id": req.request_id, "slo_s": req.slo_s, "error": error}
    if error is None and stream.first is not None and final is not None:
        # gated here, as the replay gates, from the instance: the server sees only task and gold, not
        # workload metadata such as the VT kv-split variant's item pattern, so its own verdict can differ
        text = stream.text
        record.update(client_ttft_s=stream.ttft_s, server_ttft_s=final["ttft_ms"] / 1e3,
                      is_passed=GATE.passes(inst, text), server_is_passed=final["is_passed"], answer=text,
                      sent_s=stream.sent - start, coverage=final["coverage"], plan=final["plan"],
                      batch_size=final["batch_size"], num_recomputed=final["num_recomputed"],
                      num_context_tokens=final["num_context_tokens"])
    return record


async def drive(url: str, requests: list[Request], insts: list[WorkloadInstance], model: str) -> list[dict]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, r, insts[r.request_id], model, start)) for r in requests]
        bar = tqdm(total=len(tasks), desc="live", unit="req")
        for done in asyncio.as_completed(tasks):
            await done
            bar.update(1)
        bar.close()
        return [t.result() for t in tasks]


def live_rows(records: list[dict], method: str, slo_scale: float, stats: EngineStats) -> list[dict]:
    """The live run summarized as the bench summarizes replay runs, once per clock: the server's
    TTFT, and the client's (send to first SSE event, so it includes the HTTP round trip)."""
    rows = []
    for clock in ("server", "client"):
        recs = []
        for r in records:
            if r["error"] is not None:
                recs.append({"error": r["error"], "is_qsa": False, "is_on_time": False, "is_passed": None})
                continue
            ttft = r[f"{clock}_ttft_s"]
            on_time = ttft <= r["slo_s"]
            recs.append({**r, "ttft_s": ttft, "arrival_s": r["sent_s"], "first_token_s": r["sent_s"] + ttft,
                         "is_on_time": on_time, "is_qsa": on_time and r["is_passed"] is True})
        row = summarize(method, slo_scale, recs, stats)
        rows.append({"run": f"live ({clock} clock)", **{k: row[k] for k in COLUMNS[1:]}})
    return rows


def warm_setting(pipe: RagPipeline, config: BenchConfig):
    """The setting's instances, the profile (the packaged one rescaled to this run's measured speed,
    as serving rescales it), its source, the base SLO and the speed factor; every instance's chunk
    KV stored, so the runs see a warm store."""
    insts = instances(config)
    profile, source = find_profile(pipe)
    print(f"measuring the base SLO ({source} profile) ...", file=sys.stderr, flush=True)
    base, factor = measure_base(pipe, insts[:8], profile)
    if source == "packaged":
        profile = rescaled(profile, factor, reuse_factor(profile, reuse_probes(pipe, insts[:8])))
    for inst in tqdm(insts, desc="store chunk KV", unit="inst"):
        pipe.precompute(inst.documents, inst.question, inst.prefix or None)
    return insts, profile, source, base, factor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--method", default="cachesmith")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--serial-decode", action="store_true", help="live: decode between batches, not beside")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=8 << 30)))
    config = BenchConfig("mix", None, None, args.num_requests, "poisson", args.utilization, 1.0, (args.slo_scale,),
                         (args.method,), "task", args.seed, max_batch_size=args.max_batch_size)
    insts, profile, source, base, factor = warm_setting(pipe, config)
    requests, _ = build_requests(pipe, config, insts, base, args.slo_scale)
    sched = SchedulerConfig(max_batch_size=args.max_batch_size)

    replay = Engine(pipe, profile, EngineConfig(args.method, "replay", scheduler=sched, shadow_work=shadow_calibrator))
    results = replay.run(requests, show_progress=True)
    row = summarize(args.method, args.slo_scale, [r.to_dict() for r in results], replay.stats)
    rows = [{"run": "replay", **{k: row[k] for k in COLUMNS[1:]}}]

    service = Service(ServiceConfig(engine=EngineConfig(args.method, "live", scheduler=sched,
                                                        shadow_work=shadow_calibrator),
                                    max_queue=args.num_requests, max_tokens_limit=512,
                                    is_decode_overlapped=not args.serial_decode), pipe, profile)
    with BackgroundServer(service, ServerConfig(port=0, log_level="warning")) as srv:
        records = asyncio.run(drive(srv.url, requests, insts, service.config.name))
    rows += live_rows(records, args.method, args.slo_scale, service.engine.stats)
    live_stats = service.engine.stats
    payload = {"setting": config.name, "method": args.method, "decode": "serial" if args.serial_decode else "overlapped",
               "base_slo_s": base, "slo_scale": args.slo_scale,
               "speed_factor": factor, "profile_source": source, "rows": rows, "live_records": records,
               "replay_records": [r.to_dict() for r in results],
               "batches": {"replay": replay.stats.num_batches, "live": live_stats.num_batches},
               "monitor_replans": {"replay": replay.stats.num_monitor_replans, "live": live_stats.num_monitor_replans},
               "pace_correction": {"replay": dict(replay.planner.correction), "live": dict(service.engine.planner.correction)}}
    emit(payload, args.json, args.out, lambda: (
        print(f"{config.name}: method {args.method}, base SLO {base:.2f} s x {args.slo_scale:g}"),
        print_table(rows, COLUMNS)))


if __name__ == "__main__":
    main()
