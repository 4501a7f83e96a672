"""`cachesmith workload card|export|trace`: task instances, dataset cards and arrival traces on the
command line (a thin layer over `cachesmith.workloads`); `cli.py` adds it to its parser."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cachesmith.errors import CachesmithError


def _workload_card(args: argparse.Namespace) -> int:
    from cachesmith.kvstore import ChunkStore, StoreConfig
    from cachesmith.pipeline import RagPipeline
    from cachesmith.workloads.card import measure_card, write_card

    pipe = RagPipeline(args.model, args.device, args.dtype, store=ChunkStore(StoreConfig(tiers=("memory",))))
    card = measure_card(pipe, args.task, args.variant, args.num_instances, args.seed, _knobs(args.knob),
                        corpus=_corpus(args.corpus))
    md, js = write_card(card, args.out_dir or cards_dir())
    print(card.to_json() if args.json else card.to_markdown())
    print(f"wrote {md} and {js}", file=sys.stderr)
    return 0


def cards_dir() -> Path:
    from cachesmith.model.assets import cachesmith_home

    return cachesmith_home() / "cards"


def _knobs(pairs: list[str]) -> dict[str, int]:
    knobs = {}
    for pair in pairs or []:
        name, _, value = pair.partition("=")
        try:
            knobs[name] = int(value)
        except ValueError:
            raise CachesmithError(f"--knob {pair!r}: expected NAME=INTEGER") from None
    return knobs


def _corpus(path: Path | None):
    from cachesmith.workloads.corpus import load_corpus, load_corpus_file

    corpus = load_corpus_file(path) if path else load_corpus()
    if corpus.is_synthetic:
        print("note: the Wikipedia extracts could not be fetched; using the seeded synthetic corpus",
              file=sys.stderr)
    return corpus


def _workload_trace(args: argparse.Namespace) -> int:
    from cachesmith.workloads.trace import TraceConfig, make_trace, rate_for_utilization

    rate = args.rate if args.utilization is None else rate_for_utilization(args.utilization, args.service_s)
    config = TraceConfig(pattern=args.pattern, rate_rps=rate, cv=args.cv, num_requests=args.num_requests,
                         base_slo_s=args.base_slo, slo_scale=args.slo_scale, slo_scale_max=args.slo_scale_max,
                         task=args.task, variant=args.variant, seed=args.seed)
    trace = make_trace(config)
    trace.save(args.out)
    print(f"{args.out}: {config.num_requests} {config.pattern} arrivals over {trace.requests[-1].arrival_s:.1f} s; "
          f"mean rate {trace.mean_rate_rps():.3f}/s (target {rate:.3f}), inter-arrival CV "
          f"{trace.interarrival_cv():.2f} (target {config.cv}), SLO {config.base_slo_s} s x {config.slo_scale}"
          + (f"-{config.slo_scale_max}" if config.slo_scale_max else ""))
    return 0


def _workload_export(args: argparse.Namespace) -> int:
    from cachesmith.workloads.tasks import generate_many

    insts = generate_many(args.task, args.num_instances, args.seed, args.variant, _corpus(args.corpus),
                          **_knobs(args.knob))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(i.to_json() + "\n" for i in insts), encoding="utf-8")
    tmp.replace(args.out)
    print(f"{args.out}: {len(insts)} instances of {args.task}")
    return 0


def add_parser(sub, add_model_args) -> None:
    from cachesmith.workloads.tasks import TASKS

    workload = sub.add_parser("workload", help="task instances, dataset cards and arrival traces")
    wsub = workload.add_subparsers(dest="action", required=True)
    tasks = [*TASKS, "mix"]
    card = wsub.add_parser("card", help="measure a task's full-prefill/full-reuse accuracy on the model")
    add_model_args(card)
    card.add_argument("--task", required=True, choices=list(TASKS))
    card.add_argument("--variant", default=None)
    card.add_argument("--num-instances", type=int, default=50)
    card.add_argument("--seed", type=int, default=0)
    card.add_argument("--knob", action="append", help="NAME=INT difficulty knob (repeatable)")
    card.add_argument("--corpus", type=Path, default=None, help="JSONL passages (default: Wikipedia extracts)")
    card.add_argument("--out-dir", type=Path, default=None,
                      help="where the card's .md and .json go (default: $CACHESMITH_HOME/cards; the "
                           "repository's committed cards live in docs/cards)")
    card.add_argument("--json", action="store_true", help="print the JSON card instead of markdown")
    card.set_defaults(func=_workload_card)
    export = wsub.add_parser("export", help="write instances as a workload JSONL file")
    export.add_argument("--task", required=True, choices=tasks)
    export.add_argument("--variant", default=None)
    export.add_argument("--num-instances", type=int, default=100)
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--knob", action="append", help="NAME=INT difficulty knob (repeatable)")
    export.add_argument("--corpus", type=Path, default=None, help="JSONL passages (default: Wikipedia extracts)")
    export.add_argument("--out", type=Path, required=True)
    export.set_defaults(func=_workload_export)
    trace = wsub.add_parser("trace", help="write a Poisson or Gamma arrival trace (JSONL)")
    trace.add_argument("--pattern", choices=["poisson", "gamma"], default="poisson")
    trace.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second")
    trace.add_argument("--utilization", type=float, default=None, help="set the rate as util / --service-s")
    trace.add_argument("--service-s", type=float, default=2.0, help="mean full-prefill TTFT (a card's value)")
    trace.add_argument("--cv", type=float, default=1.0)
    trace.add_argument("--num-requests", type=int, default=100)
    trace.add_argument("--base-slo", type=float, default=2.0, help="seconds")
    trace.add_argument("--slo-scale", type=float, default=2.0)
    trace.add_argument("--slo-scale-max", type=float, default=None)
    trace.add_argument("--task", choices=tasks, default="mix")
    trace.add_argument("--variant", default=None)
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--out", type=Path, required=True)
    trace.set_defaults(func=_workload_trace)
