"""The KV codecs (`--kv-codec none|int8|int4`), each measured in the same run on the packaged model.

- bytes: stored bytes per token of a 2K-token entry, float32 and bfloat16, and the ratio to the
  exact (`none`) entry of the same dtype.
- speed: encode and decode GB/s (of the model-dtype bytes), and a disk-tier read (page cache) of a
  2K-token request of four chunks through the store's reader, decoded into staging buffers, median
  of `--repeats`; `read_vs_none` = that time / the exact entries' read time.
- quality: `--per-task` requests of each task of the served mix (pr, msq, vt, mv), under full
  reuse, CacheBlend@15% and the default planner's plan for the request (planned once, on the exact
  store, and run on every codec): the first token's logits against the exact store's (max abs
  difference, top-1 agreement) and the task gate's pass count. Resumable: each answer is appended to
  $CACHESMITH_HOME/bench/kv_codec_quality.jsonl.
- capacity: a disk tier under a fixed quota and a trace of Zipf-distributed chunk reads over a
  corpus larger than the quota (a miss stores the chunk): distinct chunks held at the end and the
  hit rate, per codec, on the same trace.
`--json` prints the payload; `--out` writes it (default table on stdout).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, read_entries

from cachesmith.kvstore import ChunkStore, StoreConfig, codec
from cachesmith.kvstore.entry_format import serialize
from cachesmith.kvstore.reader import EntryReader
from cachesmith.kvstore.tiers import BytesSource
from cachesmith.model import ChunkKV
from cachesmith.model.assets import cachesmith_home
from cachesmith.model.generate import greedy_decode
from cachesmith.pipeline import RagPipeline
from cachesmith.plan_one import OnePlanner
from cachesmith.recompute import RecomputeConfig, parse_label, preset
from cachesmith.scoring import score
from cachesmith.workloads.prompts import instance_prompt
from cachesmith.workloads.tasks import MIX_TASKS, generate

CODECS = codec.CODECS
MAX_NEW_TOKENS = 32


def _random_chunk(model, num_tokens: int, dtype: torch.dtype, seed: int) -> ChunkKV:
    """KV of real shapes with a real model's spread (values do not change what bytes cost)."""
    g = torch.Generator().manual_seed(seed)
    shape = (model.num_layers, num_tokens, model.config.num_kv_heads, model.config.head_dim)
    k, v = (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 4 for _ in range(2))
    ids = list(range(seed * num_tokens, (seed + 1) * num_tokens))  # its own key
    return ChunkKV(ids, k.to(dtype), v.to(dtype), model.fingerprint)


def _entry(chunk: ChunkKV, name: str) -> bytes:
    return serialize("0" * 64, chunk.model_fingerprint, chunk.token_ids, chunk.keys, chunk.values, "", name)


def bytes_rows(model) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        chunk = _random_chunk(model, 2048, dtype, 0)
        sizes = {name: len(_entry(chunk, name)) for name in CODECS}
        rows += [{"dtype": str(dtype).removeprefix("torch."), "codec": name, "bytes_per_token": sizes[name] / 2048,
                  "vs_none": sizes[name] / sizes["none"]} for name in CODECS]
    return rows


def speed_rows(model, repeats: int) -> list[dict]:
    chunk = _random_chunk(model, 2048, torch.float32, 1)
    model_bytes = 2 * chunk.keys.numel() * chunk.keys.element_size()
    parts = [ChunkKV(list(range(i * 512, (i + 1) * 512)), chunk.keys[:, i * 512:(i + 1) * 512].contiguous(),
                     chunk.values[:, i * 512:(i + 1) * 512].contiguous(), model.fingerprint) for i in range(4)]
    rows, reads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {name: ChunkStore(StoreConfig(tiers=("disk",), root=Path(tmp) / name, codec=name)) for name in CODECS}
        keys = {name: [stores[name].put(p) for p in parts] for name in CODECS}
        for _ in range(repeats):  # interleaved, so a busy moment hits every codec alike
            for name in CODECS:
                data = _entry(chunk, name)
                encode_s = _time(lambda: _entry(chunk, name))
                decode_s = _time(lambda: EntryReader(BytesSource(data)).read_chunk())
                read_s = _time(lambda: read_entries(stores[name], keys[name]))
                reads.setdefault(name, []).append((encode_s, decode_s, read_s))
        for store in stores.values():
            store.close()
    for name in CODECS:
        encode_s, decode_s, read_s = (median([r[i] for r in reads[name]]) for i in range(3))
        rows.append({"codec": name, "encode_gbps": model_bytes / encode_s / 1e9, "decode_gbps": model_bytes / decode_s / 1e9,
                     "read_2k_s": read_s, "read_vs_none": read_s / median([r[2] for r in reads["none"]])})
    return rows


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _first_logits_and_text(pipe: RagPipeline, parts, plan: RecomputeConfig) -> tuple[torch.Tensor, str]:
    prompt = pipe.stored_prompt(parts)
    with pipe.transfer.stage([prompt], plan, [MAX_NEW_TOKENS]) as batch:
        out = pipe.runner.run(batch.requests, plan, batch)[0]
    logits = out.logits.float().reshape(-1).cpu()  # [vocab]: the first answer token's
    ids = greedy_decode(pipe.model, out.logits, out.cache, MAX_NEW_TOKENS)
    out.cache.release()
    return logits, pipe.tokenizer.decode(ids).strip()


def quality_records(per_task: int, cache: Path) -> list[dict]:
    """One record per (task, seed, method, codec), measured where the cache lacks it."""
    done = {}
    if cache.exists():
        for line in cache.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            done[(rec["task"], rec["seed"], rec["method"], rec["codec"])] = rec
    pipes = {name: RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",), codec=name))) for name in CODECS}
    planner = OnePlanner.for_pipeline(pipes["none"])
    num_layers = pipes["none"].model.num_layers
    todo = [(task, seed) for task in MIX_TASKS for seed in range(per_task)]
    with cache.open("a", encoding="utf-8") as out:
        for task, seed in tqdm(todo, desc="kv codec quality", unit="req"):
            inst = generate(task, 20_000 + seed)
            parts = instance_prompt(pipes["none"], inst)
            methods = {"full_reuse": preset("full_reuse", 0.0, num_layers),
                       "cacheblend@15%": preset("cacheblend", 0.15, num_layers)}
            key = (task, seed, "planner", "none")
            planned = done[key]["plan"] if key in done else planner.plan(parts, 5.0).config.label()
            methods["planner"] = RecomputeConfig(*parse_label(planned))
            for method, plan in methods.items():
                if all((task, seed, method, c) in done for c in CODECS):
                    continue
                runs = {name: _first_logits_and_text(pipes[name], parts, plan) for name in CODECS}
                exact_logits = runs["none"][0]
                for name, (logits, text) in runs.items():
                    rec = {"task": task, "seed": seed, "method": method, "codec": name, "plan": plan.label(),
                           "max_abs_diff": float((logits - exact_logits).abs().max()),
                           "top1_agrees": bool(logits.argmax() == exact_logits.argmax()),
                           "passed": bool(score(inst, text).passed)}
                    done[(task, seed, method, name)] = rec
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
    return [done[(t, s, m, c)] for t, s in todo for m in ("full_reuse", "cacheblend@15%", "planner") for c in CODECS]


def quality_rows(records: list[dict]) -> list[dict]:
    rows = []
    for task in MIX_TASKS:
        for method in ("full_reuse", "cacheblend@15%", "planner"):
            for name in CODECS:
                recs = [r for r in records if (r["task"], r["method"], r["codec"]) == (task, method, name)]
                rows.append({"task": task, "method": method, "codec": name, "num_requests": len(recs),
                             "passed": sum(r["passed"] for r in recs),
                             "top1_agreement": sum(r["top1_agrees"] for r in recs) / len(recs),
                             "max_abs_diff": max(r["max_abs_diff"] for r in recs)})
    return rows


def capacity_rows(model, quota_bytes: int, num_chunks: int, num_reads: int, chunk_tokens: int) -> list[dict]:
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(num_chunks)]  # Zipf(1): a few chunks are read often
    trace = rng.choices(range(num_chunks), weights, k=num_reads)
    rows = []
    for name in CODECS:
        with tempfile.TemporaryDirectory() as tmp:
            store = ChunkStore(StoreConfig(tiers=("disk",), root=Path(tmp), disk_max_bytes=quota_bytes, codec=name))
            hits = 0
            for i in tqdm(trace, desc=f"capacity {name}", unit="read", leave=False):
                chunk = _random_chunk(model, chunk_tokens, model.dtype, i)
                key = store.key_for(model, chunk.token_ids)
                if store.contains(key):
                    hits += 1
                else:
                    store.put(chunk)
            usage = store.tiers[0].usage()
            rows.append({"codec": name, "quota_bytes": quota_bytes, "chunks_held": usage.num_entries,
                         "hit_rate": hits / len(trace), "num_reads": len(trace), "corpus_chunks": num_chunks})
            store.close()
    return rows


PARTS = ("bytes", "speed", "quality", "capacity")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per-task", type=int, default=12, help="quality: requests of each task")
    ap.add_argument("--quota-mb", type=int, default=64, help="capacity: the disk quota")
    ap.add_argument("--corpus", type=int, default=200, help="capacity: distinct chunks the trace reads")
    ap.add_argument("--reads", type=int, default=1000, help="capacity: reads in the trace")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",)))).model
    payload: dict = {}
    started = time.perf_counter()
    if "bytes" in args.parts:
        payload["bytes"] = bytes_rows(model)
    if "speed" in args.parts:
        payload["speed"] = speed_rows(model, args.repeats)
    if "capacity" in args.parts:
        payload["capacity"] = capacity_rows(model, args.quota_mb << 20, args.corpus, args.reads, 64)
    if "quality" in args.parts:
        cache = cachesmith_home() / "bench" / "kv_codec_quality.jsonl"
        cache.parent.mkdir(parents=True, exist_ok=True)
        payload["quality"] = quality_rows(quality_records(args.per_task, cache))
    payload["wall_s"] = time.perf_counter() - started

    def table() -> None:
        for part in PARTS:
            if part in payload:
                print(f"\n{part}")
                print_table(payload[part], list(payload[part][0]))

    emit(payload, args.json, args.out, table)


if __name__ == "__main__":
    main()
