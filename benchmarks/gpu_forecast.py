"""A forecast of the GPU rows from the simulated device's timed mode, calibrated on the one GPU run
this project has.

`python -m benchmarks.gpu_forecast --out docs/bench/gpu_forecast.json` (CPU only; minutes: the
simulation computes every op on the CPU). The 8B shape's layers are all the same, so each run is
made at 2 and at 3 layers of a random bfloat16 8B-shaped model (written under `--work`, kept for
the next run) and scaled to 32 term by term (`sim_clock.Timing.scaled`): two, not one, so that a
plan with a WarmUp layer (CacheBlend's) has a Patch layer to scale. Each run's work is
recorded once (`sim_clock.SimClock`) and timed afterwards on any `DeviceSpec`, so the fit and both
GPUs cost no further runs.

- **Fit** (on the H200 run, torch 2.11): the host's cost per call, the run's 43.9 ms of host time for a
  2K full reuse over the 143 ops per layer it dispatched then; the compute efficiency, so that full
  prefill at 2K takes 54 ms. The memory efficiency is stated (0.8): fit so that today's eager full
  reuse at 2K kept the device busy 8.6 ms, as that run's did, it reads low (that run's device time
  was about 1,000 mostly small kernels), and the bars are given at that value too.
- **Held out**: full prefill at 8K and 16K, against 229 and 531 ms (bar: within 15%).
- **Forecast** on H100 and H200 with the fit: full prefill, full reuse and CacheBlend@15% at each
  size, graphs off and on (on: the runner replays what a 32-layer model would, and runs eager
  the runs whose device work outlasts their launches, `GraphPrefill.is_launch_bound`; those are
  also given replayed anyway, `graphs: "forced"`); decode tokens/s for 1 and 8 streams at 2K,
  graphs off and on. Each row names the term that binds it (host, compute, memory).
- **Bars** (H100, graphs on): full reuse at 2K <= 0.15x full prefill; CacheBlend@15% <= 0.35x at 2K
  and <= 0.22x at 16K; decode >= 100 tokens/s for 1 stream and >= 500 for 8.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.payload import emit, print_table
from benchmarks.common.random_model import default_tokenizer_dir, llama_config, random_weights, write_model
from cachesmith.model import ChunkKV, Decoder, Decoding
from cachesmith.model.assets import cachesmith_home
from cachesmith.recompute import BatchRunner, RecomputeRequest, cacheblend, full_reuse
from cachesmith.testing.sim_clock import H100, H200, DeviceSpec, SimClock, Timing, time_events
from cachesmith.testing.sim_cuda import SimCuda

GPU_RUN = {"device": "H200", "torch": "2.11", "full_prefill_ms": {2048: 54.0, 8192: 229.0, 16384: 531.0},
           "full_reuse_2k_host_ms": 43.9, "full_reuse_2k_device_ms": 8.6, "ops_per_layer": 143, "num_layers": 32}
NUM_LAYERS = 32
LAYERS = (2, 3)  # the model sizes run: every further layer adds what the third did
CHUNK_TOKENS, QUESTION_TOKENS = 512, 32
DECODE_CONTEXT, DECODE_STEPS = 2048, 6
MEMORY_EFFICIENCY = 0.8  # stated, not fit: the GPU run's figures do not hold it apart (see `fit`)
BARS = {"full_reuse_2k": 0.15, "cacheblend_2k": 0.35, "cacheblend_16k": 0.22, "decode_1": 100.0, "decode_8": 500.0}
Trace = list  # recorded events of one run (`SimClock.events`)


def model_dir(work: Path, num_layers: int) -> Path:
    """A random 8B-shaped model of `num_layers` layers (the tokenizer's vocabulary), written once."""
    path = work / f"random-8b-{num_layers}l"
    if not (path / "model.safetensors").exists():
        cfg = llama_config("8b", default_tokenizer_dir())
        cfg.num_hidden_layers = num_layers
        write_model(cfg, random_weights(cfg, torch.device("cpu"), torch.bfloat16), default_tokenizer_dir(), path)
    return path


def request(model: Decoder, context: int, seed: int) -> RecomputeRequest:
    """`context` tokens of stored chunks (random KV: times depend on shapes only) and a question."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    chunks = []
    for _ in range(context // CHUNK_TOKENS):
        shape = (cfg.num_layers, CHUNK_TOKENS, cfg.num_kv_heads, cfg.head_dim)
        kv = [torch.randn(shape, generator=g, dtype=model.dtype).to(model.device) for _ in range(2)]
        ids = tuple(torch.randint(3, cfg.vocab_size, (CHUNK_TOKENS,), generator=g).tolist())
        chunks.append(ChunkKV(ids, kv[0], kv[1], model.fingerprint))
    return RecomputeRequest(chunks, torch.randint(3, cfg.vocab_size, (QUESTION_TOKENS,), generator=g).tolist())


def traces_of(path: Path, sizes: list[int]) -> dict[str, Trace]:
    """Every run's recorded work on one model: full prefill, full reuse and CacheBlend@15% per size,
    graphs off, then on (the first graphed run captures, the second is recorded), and where graphs
    on ran eager (`GraphPrefill.is_launch_bound`), replayed anyway (`replay`); decode steps of 1 and
    8 streams (graphs off and on)."""
    clock, traces = SimClock(H200), _Progress(path.name)
    with SimCuda(clock=clock):
        model = Decoder(path, "cuda", torch.bfloat16)
        runner = BatchRunner(model)
        rule = runner.graphs.max_row_params
        for n in sizes:
            ids = torch.randint(3, model.config.vocab_size, (n + QUESTION_TOKENS,)).tolist()
            traces[f"prefill {n}"] = clock.record(lambda: int(model.prefill(ids)[0].argmax()))
            for name, plan in (("full_reuse", full_reuse()), ("cacheblend", cacheblend(0.15))):
                # graphs on replays what a 32-layer model would; `replay` forces the others
                runner.graphs.max_row_params = rule
                is_replayed = runner.graphs.is_launch_bound([request(model, n, seed=n)], plan, NUM_LAYERS)
                runner.graphs.max_row_params = 1 << 62  # the choice is made above, at 32 layers
                for mode in ("eager", "graph" if is_replayed else "replay"):
                    model.is_prefill_graphed = mode != "eager"
                    req = request(model, n, seed=n)
                    if model.is_prefill_graphed:
                        _release(runner.run([req], plan))  # the capture
                    traces[f"{name} {n} {mode}"] = clock.record(lambda: _release(runner.run([req], plan), read=True))
                if not is_replayed:  # graphs on ran it eager
                    traces[f"{name} {n} graph"] = traces[f"{name} {n} eager"]
        for streams in (1, 8):
            for graphed in (False, True):
                traces[f"decode {streams} {'graph' if graphed else 'eager'}"] = decode_trace(model, clock, streams,
                                                                                             graphed)
    return dict(traces)


class _Progress(dict):
    """The traces by name, each noted on stderr as it is recorded (a run takes minutes)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.start = name, time.perf_counter()

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        print(f"{self.name}: {key} recorded ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)


def _release(outs, read: bool = False) -> None:
    if read:
        outs[0].first_token  # what a server waits for: the first token on the host
    for out in outs:
        out.cache.release()


def decode_trace(model: Decoder, clock: SimClock, streams: int, graphed: bool) -> Trace:
    """`DECODE_STEPS` steps of `streams` greedy sequences at 2K context, after two steps that
    capture (graphs) and warm up."""
    ids = torch.randint(3, model.config.vocab_size, (DECODE_CONTEXT,)).tolist()
    logits, base = model.prefill(ids, extra_capacity=DECODE_STEPS + 4)
    decoding = Decoding(model, use_graphs=graphed)
    for _ in range(streams):
        decoding.start(logits, base.clone(), DECODE_STEPS + 3, eos_token_ids=())
    decoding.step()
    decoding.step()
    trace = clock.record(lambda: [decoding.step() for _ in range(DECODE_STEPS)])
    for gen in list(decoding.active):
        gen.cache.release()
    base.release()
    return trace


def at_32(one: dict[str, Trace], two: dict[str, Trace], spec: DeviceSpec) -> dict[str, Timing]:
    """Each run at 32 layers: its timing at `LAYERS[0]` layers plus what each further layer added."""
    return {k: time_events(one[k], spec).scaled(time_events(two[k], spec), NUM_LAYERS - LAYERS[0]) for k in one}


def fit(one: dict, two: dict) -> tuple[DeviceSpec, dict]:
    """The H200's host cost per call and compute efficiency from the GPU run's figures, at the
    stated memory efficiency; and the memory efficiency the run's 8.6 ms of device time for a 2K
    full reuse would give (`memory_efficiency_if_fit`: that run launched about 1,000 kernels, most
    of them small, so it reads low for the large streams of today's code; its bars are given too)."""
    host_call_s = GPU_RUN["full_reuse_2k_host_ms"] / 1e3 / (GPU_RUN["ops_per_layer"] * GPU_RUN["num_layers"])
    spec = H200.with_fit(host_call_s=host_call_s, memory_efficiency=MEMORY_EFFICIENCY)
    spec = spec.with_fit(compute_efficiency=_solve(
        lambda e: at_32(_pick(one, "prefill 2048"), _pick(two, "prefill 2048"),
                        spec.with_fit(compute_efficiency=e))["prefill 2048"].elapsed_s,
        GPU_RUN["full_prefill_ms"][2048] / 1e3))
    low = _solve(lambda e: _busy(at_32(_pick(one, "full_reuse 2048 eager"), _pick(two, "full_reuse 2048 eager"),
                                       spec.with_fit(memory_efficiency=e))["full_reuse 2048 eager"]),
                 GPU_RUN["full_reuse_2k_device_ms"] / 1e3)
    return spec, {"host_call_us": host_call_s * 1e6, "compute_efficiency": spec.compute_efficiency,
                  "memory_efficiency": spec.memory_efficiency, "memory_efficiency_if_fit": low}


def _pick(traces: dict, key: str) -> dict:
    return {key: traces[key]}


def _busy(t: Timing) -> float:
    return t.compute_s + t.memory_s


def _solve(seconds_at, target: float) -> float:
    """The efficiency in (0.01, 1] at which `seconds_at(efficiency)` (decreasing) is `target`."""
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if seconds_at(mid) > target else (lo, mid)
    return (lo + hi) / 2


def rows_for(spec: DeviceSpec, timings: dict[str, Timing], sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        full = timings[f"prefill {n}"]
        rows.append({"device": spec.name, "row": "full_prefill", "tokens": n, "graphs": "-",
                     "ms": full.elapsed_s * 1e3, "vs_full_prefill": 1.0, "binding": full.binding,
                     "calls": full.num_calls})
        for name in ("full_reuse", "cacheblend"):
            for mode in ("eager", "graph", "replay"):
                if f"{name} {n} {mode}" not in timings:
                    continue
                t = timings[f"{name} {n} {mode}"]
                rows.append({"device": spec.name, "row": name, "tokens": n,
                             "graphs": {"eager": False, "graph": True, "replay": "forced"}[mode],
                             "ms": t.elapsed_s * 1e3, "vs_full_prefill": t.elapsed_s / full.elapsed_s,
                             "binding": t.binding, "calls": t.num_calls})
    for streams in (1, 8):
        for mode in ("eager", "graph"):
            t = timings[f"decode {streams} {mode}"]
            rows.append({"device": spec.name, "row": f"decode x{streams}", "tokens": DECODE_CONTEXT,
                         "graphs": mode == "graph", "ms": t.elapsed_s * 1e3 / DECODE_STEPS, "vs_full_prefill": None,
                         "tokens_per_s": streams * DECODE_STEPS / t.elapsed_s, "binding": t.binding,
                         "calls": t.num_calls / DECODE_STEPS})
    return rows


def bars(rows: list[dict]) -> list[dict]:
    """The GPU bars on the H100 forecast, graphs on."""
    def row(name, tokens):
        return next(r for r in rows if r["device"] == H100.name and r["row"] == name and r["tokens"] == tokens
                    and r["graphs"] is True)
    checks = [("full reuse 2K / full prefill", row("full_reuse", 2048)["vs_full_prefill"], "<=", BARS["full_reuse_2k"],
               row("full_reuse", 2048)["binding"]),
              ("CacheBlend@15% 2K / full prefill", row("cacheblend", 2048)["vs_full_prefill"], "<=",
               BARS["cacheblend_2k"], row("cacheblend", 2048)["binding"]),
              ("CacheBlend@15% 16K / full prefill", row("cacheblend", 16384)["vs_full_prefill"], "<=",
               BARS["cacheblend_16k"], row("cacheblend", 16384)["binding"]),
              ("decode 1 stream, tokens/s", row("decode x1", DECODE_CONTEXT)["tokens_per_s"], ">=", BARS["decode_1"],
               row("decode x1", DECODE_CONTEXT)["binding"]),
              ("decode 8 streams, tokens/s", row("decode x8", DECODE_CONTEXT)["tokens_per_s"], ">=", BARS["decode_8"],
               row("decode x8", DECODE_CONTEXT)["binding"])]
    return [{"bar": name, "forecast": value, "limit": limit,
             "is_met": value <= limit if op == "<=" else value >= limit, "binding": binding}
            for name, value, op, limit, binding in checks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--work", type=Path, default=None, help="where the random models live (default "
                    "$CACHESMITH_HOME/forecast)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not {2048, 16384} <= set(args.sizes):
        ap.error("--sizes must hold 2048 (the fit) and 16384 (a held-out row and a bar)")
    work = args.work or cachesmith_home() / "forecast"
    start = time.perf_counter()
    one, two = (traces_of(model_dir(work, n), args.sizes) for n in LAYERS)
    spec, fitted = fit(one, two)
    held_out = [{"tokens": n, "measured_ms": GPU_RUN["full_prefill_ms"][n],
                 "forecast_ms": at_32(one, two, spec)[f"prefill {n}"].elapsed_s * 1e3}
                for n in (8192, 16384) if n in args.sizes]
    for h in held_out:
        h["error"] = h["forecast_ms"] / h["measured_ms"] - 1
    specs = [H100.with_fit(**{k: getattr(spec, k) for k in ("host_call_s", "compute_efficiency", "memory_efficiency")}),
             spec]
    rows = [r for s in specs for r in rows_for(s, at_32(one, two, s), args.sizes)]
    low = specs[0].with_fit(memory_efficiency=fitted["memory_efficiency_if_fit"])
    payload = {"gpu_run": GPU_RUN, "fit": fitted, "held_out": held_out,
               "specs": [vars(s) for s in specs], "rows": rows, "bars": bars(rows),
               "bars_if_memory_efficiency_fit": bars(rows_for(low, at_32(one, two, low), args.sizes)),
               "wall_s": time.perf_counter() - start}

    def table() -> None:
        print(f"fit: {fitted}")
        print_table(held_out, ["tokens", "measured_ms", "forecast_ms", "error"])
        print_table(rows, ["device", "row", "tokens", "graphs", "ms", "vs_full_prefill", "binding", "calls"])
        print_table(payload["bars"], ["bar", "forecast", "limit", "is_met", "binding"])
        print(f"at the memory efficiency fit to the run's full reuse ({fitted['memory_efficiency_if_fit']:.2f}):")
        print_table(payload["bars_if_memory_efficiency_fit"], ["bar", "forecast", "limit", "is_met", "binding"])
    emit(payload, args.json, args.out, table)


if __name__ == "__main__":
    main()
