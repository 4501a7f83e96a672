"""Helpers shared by the benchmarks: timing, medians, tables and JSON output."""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


import torch

from cachesmith.profiler.synthetic import random_request

__all__ = ["emit", "median", "print_table", "random_request", "timed"]


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


