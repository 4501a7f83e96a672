"""Overload: the HTTP server at 0.5x, 1x, 2x and 4x its measured capacity, with deadline-aware
shedding on and off, and a burst of requests with new documents.

Setup (one process, loopback): the packaged model, a MIX workload whose chunk KV is stored first,
the base SLO measured here (a request's full-prefill TTFT alone), and the server's capacity
measured as a saturating burst at the runs' SLO served with shedding off (requests / seconds to the
last answer). The client runs in a process of its own, as a load generator: every request
serialized before the first is due, each sent on a connection of its own opened when it is due
(`lean_http`), its times running from that connect to the response read.
Each load level sends `--num-requests` Poisson arrivals at that multiple of the capacity, each
with SLO = `--slo-scale` x base, as streaming chat completions, once with `--shed-late 1.5` and
once with `off`, each on a fresh server (same store); `--gamma-loads` adds levels whose arrivals
are Gamma with CV `--gamma-cv` (bursts from the arrival process itself, not a synthetic burst).
Each level runs `--repeats` traces (paired: one trace, both runs, which runs first alternating), and
`paired` reports per level the mean difference on - off of on-time answers and of QSA per trace,
with a 90% bootstrap interval over the traces. The burst sends `--burst` requests at once,
each with four documents nobody stored (a prefill before anything else) and `--burst-slo-ms`.
Columns: requests sent, answered on time, QSA over all sent (a refusal counts as failed), refused
at arrival and shed from the queue, the slowest and median time to a refusal at arrival, P99 TTFT
of the answered (and as a multiple of its SLO), and doomed requests answered late at full reuse.
`--out FILE` writes the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common.lean_http import Exchange
from benchmarks.common.payload import emit, print_table
from benchmarks.common.sse import Stream
from benchmarks.serve_load import warm_setting

from cachesmith.bench.setting import BenchConfig, instances
from cachesmith.engine import EngineConfig
from cachesmith.gates import make_gate
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.scheduler import SchedulerConfig
from cachesmith.scheduler.feasibility import SheddingConfig
from cachesmith.server import ServerConfig, Service, ServiceConfig
from cachesmith.server.memory_budget import AvailableMemory, human_bytes
from cachesmith.server.run import BackgroundServer
from cachesmith.workloads.trace import TraceConfig, interarrival_gaps

GATE = make_gate("task")
COLUMNS = ["run", "shedding", "sent", "on_time", "qsa", "refused_arrival", "shed_queued", "refusal_ms_max",
           "refusal_ms_p50", "shed_queued_s_max", "ttft_p99_s", "ttft_p99_vs_slo", "late_doomed"]
LOAD_COLUMNS = ["level", "repeats", "sent", "on_time_on", "on_time_off", "qsa_on", "qsa_off", "repeats_fewer_on_time",
                "on_time_first", "on_time_second"]
PAIRED_COLUMNS = ["level", "repeats", "on_time_diff", "on_time_diff_lo", "on_time_diff_hi", "qsa_diff", "qsa_diff_lo",
                  "qsa_diff_hi", "refused_arrival_on"]
CONFIDENCE = 0.90
NUM_RESAMPLES = 10_000


def body(inst, slo_s: float, model: str, documents=None) -> dict:
    messages = ([{"role": "system", "content": inst.prefix}] if inst.prefix else []) + [
        {"role": "user", "content": inst.question}]
    if inst.answer_prefix:
        messages.append({"role": "assistant", "content": inst.answer_prefix})
    return {"model": model, "messages": messages, "documents": list(documents or inst.documents), "stream": True,
            "max_tokens": inst.max_new_tokens, "slo_ms": 1e3 * slo_s, "gold": list(inst.gold), "task": inst.task}


async def one(exchange: Exchange, slo_s: float, at_s: float, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
    stream = Stream("answer")  # an error event is a refusal, not the first token
    async with exchange:
        status, headers = await exchange.response()
        if status != 200:
            error = json.loads(await exchange.body())["error"]
            return {"status": status, "code": error["code"], "refusal_s": time.perf_counter() - stream.sent,
                    "message": error["message"], "retry_after": headers.get("retry-after"), "slo_s": slo_s}
        await stream.read(exchange.lines())
    code = (stream.errors[-1]["code"] or "error") if stream.errors else None
    record = {"status": 200, "code": code, "slo_s": slo_s}
    if code is not None:
        record.update(message=stream.errors[-1]["message"], refusal_s=time.perf_counter() - stream.sent)
    if code is None and stream.first is not None:
        record.update(ttft_s=stream.ttft_s, text=stream.text)
    return record


async def _drive(url: str, sends: list[tuple[dict, float]], desc: str) -> list[dict]:
    """As a load generator sends: every request serialized before the first is due, each on a
    connection of its own opened when it is due (`lean_http`), so a request's time is the server's
    and the connection's, not the client's own work."""
    exchanges = [Exchange(url, "/v1/chat/completions", p) for p, _ in sends]
    start = time.perf_counter()
    tasks = [asyncio.create_task(one(ex, p["slo_ms"] / 1e3, at, start)) for ex, (p, at) in zip(exchanges, sends)]
    for done in tqdm(asyncio.as_completed(tasks), total=len(tasks), desc=desc, unit="req"):
        await done
    return [t.result() for t in tasks]


def drive(url: str, sends: list[tuple[dict, object, float]], desc: str) -> list[dict]:
    """The client in a process of its own (`--client`), so the server's threads and the client's
    event loop do not share one interpreter lock (that alone added 50-100 ms to a refusal in a
    burst); the answers are gated here, against their instances."""
    job = json.dumps({"url": url, "desc": desc, "sends": [(payload, at) for payload, _, at in sends]})
    # `-m`: by its path the script would not find its own package (benchmarks.common)
    child = subprocess.run([sys.executable, "-m", __spec__.name, "--client"], input=job, text=True, check=True,
                           stdout=subprocess.PIPE)
    records = json.loads(child.stdout)
    for record, (_, inst, _) in zip(records, sends):
        if "text" in record:
            record["is_passed"] = GATE.passes(inst, record.pop("text"))
    return records


def client_main() -> None:
    job = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_drive(job["url"], [tuple(x) for x in job["sends"]], job["desc"]))))


def serve(pipe, profile, args, shedding: float | None, sends, desc: str) -> tuple[list[dict], dict]:
    """The sends on a fresh server (same store): the records, and the server's own counts."""
    sched = SchedulerConfig(max_batch_size=args.max_batch_size)
    config = ServiceConfig(engine=EngineConfig(args.method, "live", scheduler=sched), max_queue=len(sends) + 8,
                           max_tokens_limit=512, shedding=SheddingConfig(shedding))
    return run_server(Service(config, pipe, profile), sends, desc)


def run_server(service: Service, sends, desc: str) -> tuple[list[dict], dict]:
    """The sends against `service` over HTTP: the records, and the server's own counts."""
    late_doomed = []  # answered past their SLO from a batch of requests the scheduler held doomed

    def hear(r) -> None:
        if r.mode == "full_reuse" and r.first_token_s is not None and r.first_token_s - r.arrival_s > r.slo_s:
            late_doomed.append(r.request_id)

    service.listeners.append(hear)
    with BackgroundServer(service, ServerConfig(port=0, log_level="error")) as srv:
        records = drive(srv.url, sends, desc)
        counts = {"shed_arrival": service.num_rejected["slo_unattainable"], "shed_queued": service.loop.num_shed_queued,
                  "late_doomed": len(late_doomed)}
    return records, counts


def summary(run: str, shedding: float | None, records: list[dict], counts: dict) -> dict:
    answered = [r for r in records if "ttft_s" in r]
    on_time = [r for r in answered if r["ttft_s"] <= r["slo_s"]]
    # a 429 at arrival, or a queued request shed at a batch boundary (its message says it waited)
    refused = [r for r in records if r["status"] == 429]
    sheds = [r["refusal_s"] for r in refused if "in the queue" in r.get("message", "")]
    refusals = sorted(1e3 * r["refusal_s"] for r in refused if "in the queue" not in r.get("message", ""))
    ttfts = np.array([r["ttft_s"] for r in answered])
    slos = np.array([r["slo_s"] for r in answered])
    return {"run": run, "shedding": "off" if shedding is None else f"{shedding:g}x", "sent": len(records),
            "on_time": len(on_time), "qsa": sum(r["is_passed"] is True for r in on_time) / len(records),
            "refused_arrival": counts["shed_arrival"], "shed_queued": counts["shed_queued"],
            "refusal_ms_max": max(refusals, default=0.0),
            "refusal_ms_p50": statistics.median(refusals) if refusals else 0.0,
            "shed_queued_s_max": max(sheds, default=0.0),
            "ttft_p99_s": float(np.quantile(ttfts, 0.99)) if len(ttfts) else 0.0,
            "ttft_p99_vs_slo": float(np.quantile(ttfts / slos, 0.99)) if len(ttfts) else 0.0,
            "late_doomed": counts["late_doomed"],
            "other_errors": sum(r["status"] == 200 and r["code"] not in (None, "slo_unattainable") or
                                r["status"] not in (200, 429) for r in records)}


def level_of(row: dict) -> str | None:
    """A run's level: its load and arrival pattern (`2x poisson`, `2x gamma cv4`); None for a burst."""
    return None if row["load"] is None else f"{row['load']:g}x {row.get('pattern', 'poisson')}"


def levels(rows: list[dict]) -> list[tuple[str, float]]:
    """Each (pattern, load) run, Poisson levels first, by load."""
    loads = {(r.get("pattern", "poisson"), r["load"]) for r in rows if r["load"] is not None}
    return sorted(loads, key=lambda level: (level[0] != "poisson", level[0], level[1]))


def by_load(rows: list[dict]) -> list[dict]:
    """Per level, the repeats summed: on time and QSA with shedding on and off, how many
    repeats shedding answered fewer on time, and on time in the first and the second run of each
    pair whatever its shedding (how much running second is worth: the noise of a pair)."""
    out = []
    for pattern, load in levels(rows):
        name = level_of({"load": load, "pattern": pattern})
        level = [r for r in rows if level_of(r) == name]
        on, off = [r for r in level if r["shedding"] != "off"], [r for r in level if r["shedding"] == "off"]
        off_by_repeat = {r["repeat"]: r for r in off}
        out.append({"level": name, "load": load, "pattern": pattern, "repeats": len(on), "sent": sum(r["sent"] for r in on),
                    "on_time_on": sum(r["on_time"] for r in on), "on_time_off": sum(r["on_time"] for r in off),
                    "qsa_on": statistics.mean(r["qsa"] for r in on), "qsa_off": statistics.mean(r["qsa"] for r in off),
                    "repeats_fewer_on_time": sum(r["on_time"] < off_by_repeat[r["repeat"]]["on_time"] for r in on),
                    "on_time_first": sum(r["on_time"] for r in level if r.get("pair_position") == 1),
                    "on_time_second": sum(r["on_time"] for r in level if r.get("pair_position") == 2)})
    return out


def bootstrap_interval(values: list[float], confidence: float = CONFIDENCE, num_resamples: int = NUM_RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return float("nan"), float("nan")
    means = np.random.default_rng(seed).choice(data, (num_resamples, data.size)).mean(axis=1)
    tail = (1.0 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def paired(rows: list[dict]) -> list[dict]:
    """Per level, the difference on - off within each trace (one arrival trace served both ways),
    its mean over the traces and a bootstrap interval of that mean: on-time answers and QSA."""
    out = []
    for pattern, load in levels(rows):
        name = level_of({"load": load, "pattern": pattern})
        level = [r for r in rows if level_of(r) == name]
        off = {r["repeat"]: r for r in level if r["shedding"] == "off"}
        pairs = [(r, off[r["repeat"]]) for r in level if r["shedding"] != "off" and r["repeat"] in off]
        on_time = [a["on_time"] - b["on_time"] for a, b in pairs]
        qsa = [a["qsa"] - b["qsa"] for a, b in pairs]
        (ot_lo, ot_hi), (q_lo, q_hi) = bootstrap_interval(on_time), bootstrap_interval(qsa)
        out.append({"level": name, "load": load, "pattern": pattern, "repeats": len(pairs), "on_time_diff": statistics.mean(on_time) if pairs else 0.0,
                    "on_time_diff_lo": ot_lo, "on_time_diff_hi": ot_hi,
                    "qsa_diff": statistics.mean(qsa) if pairs else 0.0, "qsa_diff_lo": q_lo, "qsa_diff_hi": q_hi,
                    "refused_arrival_on": sum(a["refused_arrival"] for a, _ in pairs)})
    return out


def burst_sends(insts, args, tag: str) -> list[tuple[dict, object, float]]:
    """`--burst` requests at once, each with up to four documents nobody stored (new text per run)."""
    burst = [insts[i % len(insts)] for i in range(args.burst)]
    return [(body(inst, args.burst_slo_ms / 1e3, "smollm2-135m",
                  [f"{d} (burst {tag} {i}.{j})" for j, d in enumerate(inst.documents[:4])]), inst, 0.0)
            for i, inst in enumerate(burst)]


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # the process's resident high-water mark
            return int(line.split()[1]) * 1024
    return 0


def small_machine(args) -> dict:
    """(In a child process, so its peak resident memory is the server's alone.) A server sized for a
    machine with `--small-machine-gib` available, serving the burst with shedding on."""
    available = int(args.small_machine_gib * (1 << 30))
    fake = lambda device: AvailableMemory(available, None, f"faked: {args.small_machine_gib:g} GiB")  # noqa: E731
    config = BenchConfig("mix", None, None, args.num_requests, "poisson", 1.0, 1.0, (args.slo_scale,),
                         (args.method,), "task", args.seed, max_batch_size=args.max_batch_size)
    insts = instances(config)
    service = Service(ServiceConfig(store=StoreConfig(tiers=("memory",)), max_queue=args.burst + 8), read_memory=fake)
    records, counts = run_server(service, burst_sends(insts, args, "small"), "small machine")
    budget = service.memory
    stated = budget.weights_bytes + budget.kv_bytes + budget.pool_bytes + budget.tier_bytes
    peak = peak_rss_bytes()
    return {"available_bytes": available, "budget": budget.describe(), "stated_bytes": stated,
            "peak_rss_bytes": peak, "peak_vs_available": peak / available, "peak": human_bytes(peak),
            "row": summary(f"burst of {args.burst} on a {args.small_machine_gib:g} GiB machine", 1.5, records, counts)}


def compact(records: list[dict]) -> list[dict]:
    """Each request's outcome, for reading a run again: status, code, times, the refusal's message."""
    keep = ("status", "code", "slo_s", "ttft_s", "is_passed", "refusal_s", "retry_after", "message")
    return [{k: r[k] for k in keep if k in r} for r in records]


def arrivals(pattern: str, num: int, rate: float, seed: int, cv: float = 1.0) -> list[float]:
    """Arrival times of a trace: Poisson, or Gamma gaps with coefficient of variation `cv`."""
    config = TraceConfig(pattern, rate, 1.0 if pattern == "poisson" else cv, num, seed=seed)
    return np.cumsum(interarrival_gaps(config, np.random.default_rng(seed))).tolist()


def setup(args) -> tuple[RagPipeline, object, list, float]:
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=8 << 30)))
    config = BenchConfig("mix", None, None, args.num_requests, "poisson", 1.0, 1.0, (args.slo_scale,),
                         (args.method,), "task", args.seed, max_batch_size=args.max_batch_size)
    insts, profile, _, base, _ = warm_setting(pipe, config)
    return pipe, profile, insts, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 1.0, 2.0, 4.0], help="Poisson levels")
    ap.add_argument("--gamma-loads", type=float, nargs="*", default=[2.0], help="Gamma levels (CV --gamma-cv)")
    ap.add_argument("--gamma-cv", type=float, default=4.0)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--method", default="cachesmith")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--burst", type=int, default=40, help="requests of the new-documents burst (0: none)")
    ap.add_argument("--burst-slo-ms", type=float, default=3000.0)
    ap.add_argument("--small-machine-gib", type=float, default=8.0,
                    help="also serve the burst sized for a machine with this much memory available (0: not)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the small machine's process
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the client's process
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=6,
                    help="arrival traces per load level (seeds --seed, --seed + 1, ...), each on and off")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.client:
        client_main()
        return
    if args.child:
        print(json.dumps(small_machine(args)))
        return
    began = time.perf_counter()
    pipe, profile, insts, base = setup(args)
    slo = args.slo_scale * base
    # at the runs' SLO, so the planner chooses the plans it chooses under load (a loose SLO buys
    # recomputation, and a capacity measured with it would not overload the runs)
    capacity, rows, records_by_run = 0.0, [], {}
    if args.loads or args.gamma_loads:
        saturating = [(body(inst, slo, "smollm2-135m"), inst, 0.0) for inst in insts[:args.num_requests]]
        start = time.perf_counter()
        serve(pipe, profile, args, None, saturating, "capacity")
        capacity = len(saturating) / (time.perf_counter() - start)
    plan = [(k, pattern, load) for k in range(args.repeats)
            for pattern, loads in (("poisson", args.loads), ("gamma", args.gamma_loads)) for load in loads]
    for repeat, pattern, load in plan:
        # each repeat its own arrival trace, the same for shedding on and off (a paired comparison),
        # which runs first alternating: the second run of a pair was on time more often even at 0.5x,
        # where shedding neither refuses nor sheds anything
        times = arrivals(pattern, args.num_requests, load * capacity, args.seed + repeat, args.gamma_cv)
        sends = [(body(inst, slo, "smollm2-135m"), inst, at) for inst, at in zip(insts, times)]
        name = f"{load:g}x {pattern}" + (f" cv{args.gamma_cv:g}" if pattern == "gamma" else "")
        for position, shedding in enumerate((1.5, None) if repeat % 2 == 0 else (None, 1.5), 1):
            desc = f"{name} {shedding or 'off'} #{repeat + 1}"
            records, counts = serve(pipe, profile, args, shedding, sends, desc)
            rows.append({"load": load, "pattern": name.split(" ", 1)[1], "repeat": repeat + 1,
                         "pair_position": position, **summary(f"{name} capacity", shedding, records, counts)})
            records_by_run[f"{name} {rows[-1]['shedding']} #{repeat + 1}"] = compact(records)
    for shedding in (1.5, None) if args.burst else ():
        tag = "on" if shedding else "off"  # new text each run: every document is prefilled on arrival
        sends = burst_sends(insts, args, tag)
        records, counts = serve(pipe, profile, args, shedding, sends, f"burst {tag}")
        rows.append({"load": None, **summary(f"burst of {args.burst}, new documents", shedding, records, counts)})
        records_by_run[f"burst {rows[-1]['shedding']}"] = compact(records)
    small = None
    if args.small_machine_gib > 0 and args.burst:
        child = subprocess.run([sys.executable, "-m", __spec__.name, "--child", *sys.argv[1:]], check=True,
                               text=True, stdout=subprocess.PIPE)
        small = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append({"load": None, **small["row"]})
    payload = {"setting": f"mix, {args.num_requests} requests per level, Poisson and Gamma CV {args.gamma_cv:g}",
               "method": args.method, "base_slo_s": base, "slo_scale": args.slo_scale, "slo_s": slo,
               "capacity_rps": capacity, "burst_slo_ms": args.burst_slo_ms, "repeats": args.repeats, "rows": rows,
               "by_load": by_load(rows), "paired": paired(rows), "confidence": CONFIDENCE,
               "small_machine": small, "records": records_by_run, "wall_s": time.perf_counter() - began}
    emit(payload, args.json, args.out, lambda: (
        print(f"capacity {capacity:.3f} req/s; SLO {slo:.2f} s ({args.slo_scale:g}x base {base:.2f} s)"),
        print_table(rows, COLUMNS),
        args.repeats > 1 and print_table(payload["by_load"], LOAD_COLUMNS),
        args.repeats > 1 and print_table(payload["paired"], PAIRED_COLUMNS),
        small and print(f"small machine: {small['budget']}; peak resident {small['peak']} "
                        f"({small['peak_vs_available']:.0%} of the memory available)")))


if __name__ == "__main__":
    main()
