"""`cachesmith store stats|prune`: the chunk store's contents and bounds on the command line, a thin
layer over the store's tiers (`DiskTier.usage`/`prune`, `RedisTier.usage`); `cli.py` adds it to its
parser, and `serve`'s `--disk-max-bytes`, `--redis-ttl-s` and `--redis-max-bytes` (`add_bounds_args`, `store_bounds`).

  cachesmith store stats [--store-root DIR] [--tiers disk redis --redis-url URL] [--disk-max-bytes N]
  cachesmith store prune (--max-bytes N | --older-than DAYS) [--store-root DIR]

In: the flags. Out: one line per tier (entries, bytes, quota, oldest access) on stdout; prune's
progress on stderr. Entries are content-addressed, so prune goes by size and age, whatever model
an entry is for.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from cachesmith.errors import CachesmithError
from cachesmith.kvstore.codec import CODECS

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?")
PROGRESS_EVERY_S = 1.0


def parse_bytes(text: str) -> int:
    """Bytes from `20G`, `500M`, `1.5T`, `64KiB` or `1048576`; suffixes are powers of 1024."""
    match = _BYTES.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 20G, 500M or 1048576 "
                                         f"(K, M, G, T are powers of 1024)")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def _human(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def add_bounds_args(p: argparse.ArgumentParser) -> None:
    """The store's bounds, for `serve` (and `store stats`)."""
    p.add_argument("--disk-max-bytes", type=parse_bytes, default=None,
                   help="disk tier quota, e.g. 20G (default or 0: 50%% of the free space plus what the store "
                        "holds, at start); least recently used entries not in use are evicted")
    p.add_argument("--redis-ttl-s", type=int, default=None,
                   help="redis entries expire this long after their last write or read (default 604800, "
                        "7 days; 0: never)")
    p.add_argument("--redis-max-bytes", type=parse_bytes, default=None,
                   help="set the redis server's maxmemory to this (e.g. 8G) with allkeys-lru at start (default: "
                        "leave the server's own; a managed redis that refuses CONFIG SET is an error)")


def add_codec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-codec", choices=CODECS, default="none",
                   help="how new chunk KV entries are stored: none (as computed), int8 (about a quarter of "
                        "float32's bytes) or int4 (about an eighth); entries of each codec have their own keys")


def store_bounds(args: argparse.Namespace) -> dict:
    """`StoreConfig` fields from `add_bounds_args`' (and `add_codec_arg`'s) flags; an unset flag keeps
    StoreConfig's default."""
    bounds = {"disk_max_bytes": args.disk_max_bytes, "redis_max_bytes": getattr(args, "redis_max_bytes", None),
              "codec": getattr(args, "kv_codec", "none")}
    if getattr(args, "redis_ttl_s", None) is not None:
        bounds["redis_ttl_s"] = args.redis_ttl_s or None  # 0: no expiry
    return bounds


def _open_store(args: argparse.Namespace, tiers: tuple[str, ...]):
    from cachesmith.kvstore import ChunkStore, StoreConfig
    from cachesmith.model.assets import cachesmith_home

    root = args.store_root or cachesmith_home() / "kv"
    if "disk" in tiers and not Path(root).is_dir():  # a typo must not create an empty store
        raise CachesmithError(f"--store-root {root}: no store there (not a directory)")
    return ChunkStore(StoreConfig(tiers=tiers, root=root, redis_url=args.redis_url, **store_bounds(args)))


def _stats(args: argparse.Namespace) -> int:
    tiers = tuple(args.tiers or ["disk"] + (["redis"] if args.redis_url else []))
    store = _open_store(args, tiers)
    try:
        for tier in store.tiers:
            print(_usage_line(tier))
        print(_codec_line(store))
    finally:
        store.close()
    return 0


MAX_DESCRIBED = 2000  # entries whose headers `store stats` reads for its codec line


def _codec_line(store) -> str:
    """Entries and stored bytes per token by codec (`--kv-codec`), from the headers of up to
    `MAX_DESCRIBED` entries (a store of millions is sampled, and says so)."""
    from collections import Counter

    keys = store.keys()
    entries, num_bytes, num_tokens = Counter(), Counter(), Counter()
    for key in keys[:MAX_DESCRIBED]:
        found = store.describe(key)
        if found is not None:
            header = found[0]
            entries[header.codec] += 1
            num_bytes[header.codec] += header.total_bytes
            num_tokens[header.codec] += header.num_tokens
    parts = [f"{codec} {entries[codec]} entries, {num_bytes[codec] / max(1, num_tokens[codec]):,.0f} bytes/token"
             for codec in sorted(entries)]
    sampled = f" (the first {MAX_DESCRIBED} of {len(keys)} entries)" if len(keys) > MAX_DESCRIBED else ""
    return "codecs " + ("; ".join(parts) or "no entries") + sampled


def _usage_line(tier) -> str:
    usage = tier.usage()
    line = f"{usage.tier:<6} entries {usage.num_entries}  bytes {usage.num_bytes} ({_human(usage.num_bytes)})  "
    from cachesmith.kvstore.disk_quota import DEFAULT_DISK_FRACTION

    if usage.max_bytes is None:
        line += "quota none"
    else:
        is_default = getattr(tier, "is_default_quota", False)
        line += f"quota {usage.max_bytes} ({_human(usage.max_bytes)}" + (
            f", default: {DEFAULT_DISK_FRACTION:.0%} of free + stored at start)" if is_default else ")")
    if usage.tier == "disk":
        line += f"  oldest access {_when(usage.oldest_access)}  root {tier.root}"
    return line + (f"  [{usage.note}]" if usage.note else "")


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    days = (time.time() - timestamp) / 86400
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) + f" ({days:.1f} days ago)"


def _prune(args: argparse.Namespace) -> int:
    if args.max_bytes is None and args.older_than is None:
        raise CachesmithError("store prune needs --max-bytes N and/or --older-than DAYS")
    if args.older_than is not None and args.older_than < 0:
        raise CachesmithError(f"--older-than {args.older_than}: must be a number of days >= 0")
    store = _open_store(args, ("disk",))
    disk = store.tiers[0]
    last = [time.monotonic()]

    def progress(num_entries: int, num_bytes: int) -> None:
        if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            print(f"pruning: entries {num_entries}  bytes {num_bytes} ({_human(num_bytes)}) so far",
                  file=sys.stderr, flush=True)

    older_than_s = None if args.older_than is None else args.older_than * 86400
    num_pruned, num_freed = disk.prune(args.max_bytes, older_than_s, progress)
    left = disk.usage()
    print(f"disk   pruned entries {num_pruned}  bytes {num_freed} ({_human(num_freed)}); left entries "
          f"{left.num_entries}  bytes {left.num_bytes} ({_human(left.num_bytes)})  root {disk.root}")
    return 0


def add_parser(sub) -> None:
    store = sub.add_parser("store", help="the chunk store's entries, bytes and bounds; prune the disk tier")
    actions = store.add_subparsers(dest="action", required=True)
    stats = actions.add_parser("stats", help="per tier: entries, bytes, quota; the disk tier's oldest access")
    _add_location_args(stats)
    stats.add_argument("--tiers", nargs="+", default=None, choices=["disk", "redis"],
                       help="default: disk, and redis with --redis-url (memory is each server's own)")
    stats.add_argument("--redis-url", default=None, help="e.g. redis://127.0.0.1:6379/0")
    add_bounds_args(stats)
    stats.set_defaults(func=_stats)
    prune = actions.add_parser("prune", help="evict least recently used disk entries, of any model (entries are "
                                             "content-addressed): down to --max-bytes and/or unused for --older-than")
    _add_location_args(prune)
    prune.add_argument("--max-bytes", type=parse_bytes, default=None, help="keep at most this much, e.g. 20G")
    prune.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                       help="evict entries not read or written for this many days")
    prune.set_defaults(func=_prune, redis_url=None, disk_max_bytes=None, redis_ttl_s=None)


def _add_location_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-root", type=Path, default=None, help="disk tier root (default $CACHESMITH_HOME/kv)")
