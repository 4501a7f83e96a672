"""Helpers shared by the benchmarks: timing, medians, tables and JSON output (with its provenance)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from cachesmith.model.device import synchronize
from cachesmith.planner import Profile, ProfileError
from cachesmith.calibration.synthetic import random_request

__all__ = ["emit", "load_profile", "median", "parse_timing_args", "print_table", "provenance", "random_request",
           "read_entries", "timed"]

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
    """Seconds `fn` took, the device synchronized on both sides (a GPU runs behind the host)."""
    if device is not None:
        synchronize(device)
    start = time.perf_counter()
    fn()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - start


def read_entries(store, keys: list[str]) -> int:
    """Every layer of each entry of the store's first tier (a disk tier), read through the store's
    reader (verified, decoded) into staging tensors; the bytes read."""
    from cachesmith.kvstore.reader import EntryReader
    from cachesmith.kvstore.tiers import FileSource

    total = 0
    for key in keys:
        reader = EntryReader(FileSource(store.tiers[0].path(key)))
        h = reader.header
        k = torch.empty((h.num_tokens, h.num_kv_heads, h.head_dim), dtype=h.torch_dtype)
        v = torch.empty_like(k)
        for layer in range(h.num_layers):
            total += reader.read_layer_into(layer, k, v)
        reader.close()
    return total


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(rows: list[dict], columns: list[str], file=sys.stdout) -> None:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=file)
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)), file=file)


def _commit() -> str:
    """The commit measured, with "+changes" when the working tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.machine()}, {os.cpu_count()} cores"


PROVENANCE: dict[str, Callable[[], str]] = {
    "command": lambda: " ".join(sys.argv),
    "commit": _commit,
    "date": lambda: datetime.now(UTC).isoformat(timespec="seconds"),
    "machine": lambda: f"{_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads",
}


def provenance(payload: dict) -> dict:
    """`payload` with what produced it added where it lacks the key: `command` (this process's
    argv), `commit` (short HEAD, "+changes" when tracked files differ, "unknown" without git),
    `date` (UTC, ISO) and `machine` (CPU model and cores, torch version and threads)."""
    return {**payload, **{k: make() for k, make in PROVENANCE.items() if k not in payload}}


def emit(payload, as_json: bool, out: str | None, table: Callable[[], None]) -> None:
    """--json prints only JSON on stdout; otherwise a table. --out always writes the JSON file. A
    dict payload gets its provenance (`provenance`) in both."""
    if isinstance(payload, dict):
        payload = provenance(payload)
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
    from cachesmith.calibration.packaged import PACKAGED_DIR, measured_or_packaged

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
