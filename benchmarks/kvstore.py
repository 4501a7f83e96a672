"""Chunk KV store: read throughput against a plain sequential read, and transfer stalls.

read: every layer of --entries stored chunks read through the store's reader (verified, into staging
tensors) vs a plain sequential read of the same files (`f.read()`; also readv into one reused
buffer, for reference), all from the page cache, interleaved, median of 3. stall: a 2K-token (kv_dev,1,0,15%) prefill on the packaged model with the
KV on the disk tier, prefetch on/off, link capped at 10 / 6 / 3 GB/s; stall_fraction = time the runner
waited for KV / TTFT. `--json` prints {"read": {...}, "stall": [...]}.
"""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
import random
import tempfile
from pathlib import Path

import torch

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, read_entries, timed

from cachesmith.calibration.synthetic import random_request
from cachesmith.kvstore import ChunkStore, StoreConfig, TransferConfig, TransferEngine, put_prompt
from cachesmith.model import Decoder, Tokenizer, prefill_chunk, resolve_model
from cachesmith.recompute import BatchRunner, preset


def _plain_read(paths: list[Path]) -> int:
    """The plain sequential read the target compares against: each file read whole."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            total += len(fh.read())
    return total


def _readv_read(paths: list[Path]) -> int:
    """A tighter floor, for reference: readv into one reused 8 MiB buffer."""
    total = 0
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total


def _store_read_parallel(store: ChunkStore, keys: list[str], num_workers: int) -> int:
    """The same reads spread over worker threads, as the transfer engine issues them."""
    with ThreadPoolExecutor(num_workers) as pool:
        return sum(pool.map(lambda k: read_entries(store, [k]), keys))


def run_read(model: Decoder, root: Path, num_entries: int, tokens: int) -> dict:
    store = ChunkStore(StoreConfig(tiers=("disk",), root=root))
    rng = random.Random(0)
    keys = [store.put(prefill_chunk(model, [rng.randrange(model.config.vocab_size) for _ in range(tokens)]))
            for _ in range(num_entries)]
    paths = [store.tiers[0].path(k) for k in keys]
    nbytes = sum(p.stat().st_size for p in paths)
    raw_t, readv_t, store_t, par_t = [], [], [], []
    for _ in range(3):
        raw_t.append(timed(lambda: _plain_read(paths)))
        readv_t.append(timed(lambda: _readv_read(paths)))
        store_t.append(timed(lambda: read_entries(store, keys)))
        par_t.append(timed(lambda: _store_read_parallel(store, keys, 2)))
    raw, st, par = (nbytes / median(t) / 1e9 for t in (raw_t, store_t, par_t))
    return {"bytes": nbytes, "raw_gbps": raw, "store_gbps": st, "ratio": st / raw,
            "store_2_workers_gbps": par, "ratio_2_workers": par / raw,
            "readv_reused_buffer_gbps": nbytes / median(readv_t) / 1e9}


def run_stall(model: Decoder, tok: Tokenizer, root: Path, caps: list[float], repeats: int) -> list[dict]:
    store = ChunkStore(StoreConfig(tiers=("disk",), root=root))
    req, _ = random_request(model, tok.rag_prompt_parts(["x"], "q").prefix_ids, 2048, random.Random(1))
    keyed = put_prompt(store, req.chunks, req.suffix_ids, req.prefix)
    plan = preset("cacheblend", 0.15, model.num_layers)
    runner, rows = BatchRunner(model), []
    for cap in caps:
        for is_prefetch in (True, False):
            engine = TransferEngine(store, model, TransferConfig(bandwidth_gbps=cap, is_prefetch=is_prefetch))
            ttfts, stalls = [], []
            for _ in range(repeats):
                def once():
                    with engine.stage([keyed], plan) as batch:
                        runner.run(batch.requests, plan, batch)
                    stalls.append(batch.stall_s)
                ttfts.append(timed(once))
            ttft = median(ttfts)
            rows.append({"cap_gbps": cap, "prefetch": is_prefetch, "ttft_s": ttft,
                         "stall_s": median(stalls), "stall_fraction": median(stalls) / ttft,
                         "effective_gbps": engine.stats.effective_gbps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--entries", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--caps", type=float, nargs="+", default=[10.0, 6.0, 3.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="results/kvstore.json")
    args = ap.parse_args()
    path = resolve_model(args.model)
    model, tok = Decoder(path), Tokenizer(path)
    with tempfile.TemporaryDirectory(prefix="cachesmith-bench-") as tmp:
        read = run_read(model, Path(tmp) / "read", args.entries, args.tokens)
        stall = run_stall(model, tok, Path(tmp) / "stall", args.caps, args.repeats)

    def tables():
        print_table([read], ["bytes", "raw_gbps", "store_gbps", "ratio", "store_2_workers_gbps",
                             "ratio_2_workers", "readv_reused_buffer_gbps"])
        print_table(stall, ["cap_gbps", "prefetch", "ttft_s", "stall_s", "stall_fraction", "effective_gbps"])
    emit({"read": read, "stall": stall}, args.json, args.out, tables)


if __name__ == "__main__":
    main()
