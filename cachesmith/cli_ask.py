"""`cachesmith ask`: one question over document files, answered under a fixed plan or the planner's
plan for the request alone (`plan_one`); `cli.py` adds it to its parser.

  cachesmith ask --doc FILE ... --question TEXT [--method cachesmith --slo-ms 5000 | cacheblend@0.15 | ...]

In: the flags. Out: the answer on stdout; the plan, what it recomputed and the TTFT on stderr (with
`cachesmith`, also where the profile came from and the planner's price). A fixed plan never loads a
profile.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cachesmith.errors import CachesmithError

if TYPE_CHECKING:
    from cachesmith.methods import Method


def ask(args: argparse.Namespace) -> int:
    from cachesmith.pipeline import RagPipeline
    from cachesmith.plan_one import OnePlanner
    from cachesmith.request import DEFAULT_SLO_S

    docs = []
    for path in args.doc:
        try:
            docs.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise CachesmithError(f"--doc {path}: cannot be read as UTF-8 text ({exc})") from exc
    method = _ask_method(args)  # checked before the model loads
    pipe = RagPipeline(args.model, args.device, args.dtype)
    if method is not None:
        ans = pipe.answer(docs, args.question, method.plan(pipe.model.num_layers), args.max_new_tokens)
        label = ans.plan
    else:
        slo_s = DEFAULT_SLO_S if args.slo_ms is None else args.slo_ms / 1e3
        planner = OnePlanner.for_pipeline(pipe, args.profile)  # a fixed method never loads a profile
        print(f"profile: {planner.source}", file=sys.stderr, flush=True)
        ans = planner.answer(pipe, docs, args.question, slo_s, args.max_new_tokens)
        label = f"cachesmith {ans.plan} for SLO {slo_s * 1e3:.0f} ms, planned {ans.planned_s:.3f} s"
    print(ans.text)
    print(f"[{label}: recomputed {ans.num_recomputed}/{ans.num_context_tokens} context tokens, "
          f"TTFT {ans.ttft_s:.3f} s]", file=sys.stderr)
    return 0


def _ask_method(args: argparse.Namespace) -> Method | None:
    """The fixed plan's `Method`, or None: the planner chooses (`cachesmith`). A bare preset name
    takes --coverage (the older spelling); other names are `methods.parse_method`'s."""
    from cachesmith.methods import Method, parse_method
    from cachesmith.recompute import PRESET_NAMES
    from cachesmith.recompute.config import check_coverage

    if args.method in PRESET_NAMES:
        check_coverage(args.coverage, "--coverage")
        method = Method(args.method, args.method, args.coverage, scheduling="fcfs")
    else:
        method = parse_method(args.method)
        if method.name == "cachesmith":
            _check_slo_ms(args.slo_ms)
            return None
        if not method.is_static or method.is_queue_aware:
            raise CachesmithError(f"--method {args.method!r}: ask answers one request alone; use cachesmith "
                                  f"(the planner), full_prefill, full_reuse or <preset>@<coverage> "
                                  f"(e.g. cacheblend@0.15)")
    for flag, value in (("--slo-ms", args.slo_ms), ("--profile", args.profile)):
        if value is not None:
            raise CachesmithError(f"{flag} applies to --method cachesmith only ({args.method} is a fixed plan)")
    return method


def _check_slo_ms(slo_ms: float | None) -> None:
    if slo_ms is not None and not (math.isfinite(slo_ms) and slo_ms > 0):
        raise CachesmithError(f"--slo-ms {slo_ms}: must be a positive, finite number of milliseconds")


def add_parser(sub, add_model_args) -> None:
    from cachesmith.recompute import PRESET_NAMES

    parser = sub.add_parser("ask", help="answer a question over document files")
    add_model_args(parser)
    parser.add_argument("--doc", action="append", required=True, help="a UTF-8 text file (repeatable)")
    parser.add_argument("--question", required=True)
    parser.add_argument("--method", default="cachesmith",
                        help="cachesmith (the planner chooses the plan under --slo-ms; default), full_prefill, "
                             "full_reuse, <preset>@<coverage> (e.g. cacheblend@0.15), or a preset name of "
                             f"{', '.join(PRESET_NAMES)} with --coverage")
    parser.add_argument("--coverage", type=float, default=0.15, help="with a bare preset name")
    parser.add_argument("--slo-ms", type=float, default=None,
                        help="with cachesmith: the TTFT budget the planner plans for (default 5000, the server's)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="with cachesmith: the planner's profile (default: measured, else the packaged one)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.set_defaults(func=ask)
