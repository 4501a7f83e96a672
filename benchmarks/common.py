"""Helpers shared by the benchmarks: timing, medians, tables and JSON output."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


import torch

from cachesmith.planner import Profile, ProfileError
from cachesmith.profiler.synthetic import random_request

__all__ = ["emit", "load_profile", "median", "parse_timing_args", "print_table", "random_request", "timed"]

MEASURED = "smollm2-135m-float32-cpu.json"  # what `cachesmith profile` writes for the packaged model


def parse_timing_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Add --threads, --json and --out to a timing benchmark's parser, parse, and apply --threads."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(rows: list[dict], columns: list[str], file=sys.stdout) -> None:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=file)
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)), file=file)


def emit(payload, as_json: bool, out: str | None, table: Callable[[], None]) -> None:
    """--json prints only JSON on stdout; otherwise a table. --out always writes the JSON file."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=1))
    if as_json:
        print(json.dumps(payload))
    else:
        table()


def load_profile(path: Path | None) -> tuple[Profile, str]:
    """(profile, "given" | "measured" | "packaged") for benchmarks that load no model. An explicit
    `path` must be usable (else exit naming the fault); by default the measured profile of the
    packaged model, else the packaged one as shipped (not rescaled: no model runs here to measure
    this machine's speed). Where it came from goes to stderr, so `--json` output stays JSON."""
    from cachesmith.model.assets import cachesmith_home
    from cachesmith.profiler.packaged import PACKAGED_DIR, measured_or_packaged

    own = cachesmith_home() / "profiles" / MEASURED
    try:
        profile, source = (Profile.load(path), "given") if path is not None else measured_or_packaged(own)
    except ProfileError as exc:
        raise SystemExit(f"error: {exc}") from None
    where = {"given": f"{path}", "measured": f"{own}",
             "packaged": f"{PACKAGED_DIR / MEASURED}, as shipped: no usable measured profile at {own} "
                         f"(run `cachesmith profile` to measure this machine)"}[source]
    print(f"profile: {source} ({where})", file=sys.stderr, flush=True)
    return profile, source
