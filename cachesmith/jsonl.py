"""Resumable JSONL caches of long offline jobs (dataset cards, demand profiling, the simulated
grid): one JSON record per line, each with a unique `key`; a run appends as it goes and a stopped
run reloads what is there.

In: a path. Out: {key: record}; a line cut short by an interrupted run is skipped (measured again).
"""
from __future__ import annotations

import json
from pathlib import Path


def load_keyed(path: Path) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec
            except (ValueError, KeyError, TypeError):
                continue
    return done
