"""Full reuse through the store against its limit, on the packaged model.

For contexts of 2K and 8K tokens (2048 and 8000: 8192 plus the suffix would pass the model's 8192
positions; 16 stored chunks each), batches of 1, 4 and 8 requests, float32 and bfloat16, with the
chunk KV on the disk tier (page-cached: read once before timing):
- `full_reuse_s`: staging through the transfer engine plus the runner's full-reuse plan (the
  suffix recomputed over the stitched cache) up to the first tokens: what serving runs;
- `limit_s`, measured in the same run: the suffix rows' compute (a forward of every request's
  suffix over a cache of the same context, linear layers batched over the batch's rows) plus one
  copy of the batch's KV bytes into memory already mapped;
- `full_prefill_s`: one request's full prefill times the batch size (measured once per context);
- `fixed_s`: the per-batch fixed cost inside `full_reuse_s` (opening every entry, giving each
  request its cache, assembling the sequences) with a plan that loads nothing.
Caches are released after each timed run, as serving does, so the steady state is measured.
`--json` prints the list of rows; `--out` writes it. Target: full_reuse_s / limit_s <= 2.0.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, parse_timing_args, timed

from cachesmith.kvstore import ChunkStore, StoredEntry, StoredPrompt, StoreConfig, TransferEngine
from cachesmith.model import Decoder, resolve_model
from cachesmith.recompute import BatchRunner, preset
from cachesmith.recompute.sequence import build_sequence

NUM_CHUNKS, NUM_SUFFIX = 16, 19


def _requests(model: Decoder, store: ChunkStore, context: int, batch: int, seed: int):
    """`batch` requests over the same 16 stored chunks in different orders (distinct assembled
    caches, one precompute)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    chunks = [[rng.randrange(vocab) for _ in range(context // NUM_CHUNKS)] for _ in range(NUM_CHUNKS)]
    entries = [StoredEntry(store.ensure(model, c)[0], len(c)) for c in chunks]
    out = []
    for _ in range(batch):
        order = rng.sample(range(NUM_CHUNKS), NUM_CHUNKS)
        suffix = tuple(rng.randrange(vocab) for _ in range(NUM_SUFFIX))
        out.append(StoredPrompt(tuple(entries[i] for i in order), suffix))
    flat = [t for c in chunks for t in c] + list(out[0].suffix_ids)
    return out, flat


def _reuse(model: Decoder, engine: TransferEngine, runner: BatchRunner, requests: list[StoredPrompt]):
    plan = preset("full_reuse", 0.0, model.num_layers)

    def run():
        with engine.stage(requests, plan) as staged:
            outs = runner.run(staged.requests, plan, staged)
            [o.first_token for o in outs]
        return outs
    return run


def _suffix_forward(model: Decoder, caches, suffixes: list[list[int]]) -> None:
    """The limit's compute: every suffix over its own context cache, linear parts batched."""
    with torch.inference_mode():
        starts = [c.num_tokens for c in caches]
        cos_sin = [model.rope.cos_sin(torch.arange(s, s + len(x))) for s, x in zip(starts, suffixes)]
        h = model.embed(torch.tensor([t for x in suffixes for t in x]))  # [sum n, hidden]
        for i, layer in enumerate(model.layers):
            q, k, v = layer.qkv(layer.input_norm(h))
            outs, a = [], 0
            for cache, start, x, (cos, sin) in zip(caches, starts, suffixes, cos_sin):
                b, end = a + len(x), start + len(x)
                cache.write(i, start, model.rope.apply(k[a:b], cos, sin), v[a:b])
                mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                keys, values = cache.view(i, end)
                outs.append(layer.attend(model.rope.apply(q[a:b], cos, sin), keys, values, mask=mask))
                a = b
            h = layer.mlp_block(h.add_(layer.out_proj(torch.cat(outs))))
        last = torch.tensor([len(x) for x in suffixes]).cumsum(0) - 1
        model.head(model.norm(h[last]))


def _limit(model: Decoder, caches, suffixes, context: int, repeats: int) -> float:
    num_bytes = sum(2 * c.key_slab[:, :context].numel() * c.key_slab.element_size() for c in caches)
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src).fill_(0.0)  # touched: the copy runs into mapped memory

    def run():
        for c in caches:
            c.num_tokens = context
        _suffix_forward(model, caches, suffixes)
        dst.copy_(src)
    run()
    return median([timed(run) for _ in range(repeats)])


def _fixed(model: Decoder, engine: TransferEngine, requests: list[StoredPrompt], repeats: int) -> float:
    """Per-batch fixed cost: opening every entry, giving each request its cache, assembling the
    sequences, closing; with a plan that loads nothing."""
    plan = preset("full_prefill", 0.0, model.num_layers)

    def run():
        with engine.stage(requests, plan) as staged:
            for i, r in enumerate(staged.requests):
                build_sequence(model, r, 0.0, i)
        for r in staged.requests:
            r.cache.release()
    run()
    return median([timed(run) for _ in range(repeats)])


def measure(dtype: str, contexts: list[int], batches: list[int], repeats: int, root: Path) -> list[dict]:
    model = Decoder(resolve_model("smollm2-135m"), "cpu", dtype)
    store = ChunkStore(StoreConfig(tiers=("disk",), root=root / dtype))
    engine, runner, rows = TransferEngine(store, model), BatchRunner(model), []
    for context in contexts:
        requests, flat = _requests(model, store, context, max(batches), seed=context)
        full = timed(lambda: model.prefill(flat)[1].release())
        for batch in tqdm(batches, desc=f"reuse {dtype} {context}", file=sys.stderr):
            run = _reuse(model, engine, runner, requests[:batch])
            caches = [o.cache for o in run()]  # warm: page cache, pool, threads
            limit = _limit(model, caches, [r.suffix_ids for r in requests[:batch]], context, repeats)
            for c in caches:
                c.release()
            times = []
            for _ in range(repeats):
                outs = []
                times.append(timed(lambda: outs.extend(run())))
                for o in outs:
                    o.cache.release()
            reuse = median(times)
            rows.append({"dtype": dtype, "context_tokens": context, "batch_size": batch,
                         "full_reuse_s": reuse, "limit_s": limit, "full_prefill_s": full * batch,
                         "fixed_s": _fixed(model, engine, requests[:batch], repeats),
                         "vs_limit": reuse / limit, "vs_full_prefill": reuse / (full * batch)})
    engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 8000])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    args = parse_timing_args(ap)
    with tempfile.TemporaryDirectory(prefix="cachesmith-reuse-") as tmp:
        rows = [r for d in args.dtypes for r in measure(d, args.contexts, args.batches, args.repeats, Path(tmp))]
    cols = ["dtype", "context_tokens", "batch_size", "full_reuse_s", "limit_s", "vs_limit", "fixed_s",
            "full_prefill_s", "vs_full_prefill"]
    emit({"rows": rows}, args.json, args.out, lambda: print_table(rows, cols))


if __name__ == "__main__":
    main()
