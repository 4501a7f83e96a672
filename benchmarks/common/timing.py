"""Timing a benchmark's steps: its --threads, a timed call, the median, and a store's entries read."""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from cachesmith.model.device import synchronize


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


def median(values: list[float]) -> float:
    return statistics.median(values)


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
