"""A benchmark's output: its table, and its JSON payload stamped with what produced it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

__all__ = ["PROVENANCE", "command", "commit", "cpu", "emit", "print_table", "provenance"]


def print_table(rows: list[dict], columns: list[str], file=sys.stdout) -> None:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    widths = [max([len(c), *(len(fmt(r[c])) for r in rows)]) for c in columns]  # no rows: the header
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=file)
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)), file=file)


def command() -> str:
    """How this process was started, as one reruns it: `python -m benchmarks.NAME ARGS` for a
    module (under `-m`, argv[0] is the script's absolute path, which names no rerun), else argv."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name.removesuffix(".__main__") if spec is not None else "__main__"
    head = [f"python -m {name}"] if name != "__main__" else sys.argv[:1]
    return " ".join(head + sys.argv[1:])


def commit() -> str:
    """The commit measured, with "+changes" when the working tree's code differs from it (payloads
    in `docs/bench/` aside: a run of several benchmarks writes them as it goes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)docs/bench") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.machine()}, {os.cpu_count()} cores"


PROVENANCE: dict[str, Callable[[], str]] = {
    "command": command,
    "commit": commit,
    "date": lambda: datetime.now(UTC).isoformat(timespec="seconds"),
    "machine": lambda: f"{cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads",
}


def provenance(payload: dict) -> dict:
    """`payload` with what produced it added where it lacks the key: `command` (`command()`),
    `commit` (short HEAD, "+changes" when tracked files differ, "unknown" without git),
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
