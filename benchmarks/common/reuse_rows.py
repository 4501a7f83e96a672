"""The GPU check's reuse rows (`benchmarks/gpu_check.py`): each method on one context, from chunk
KV already on the device (`direct`: graphed where the plan is graphable, and eager beside it) and
staged from a memory-tier store (`store`), against our full prefill.

In: the rows so far, the check's clock, the model and its runner, one request and context, the full
prefill's milliseconds, the `Timer`. Out: two rows per method appended (`method_rows`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common.check_rows import guarded
from benchmarks.common.timing import median, timed
from cachesmith.model import Decoder
from cachesmith.methods import parse_method
from cachesmith.recompute import BatchRunner

# one plan of each graphed family: position, KV deviation at two coverages, the question's attention
METHODS = ("full_reuse", "cacheblend@0.15", "cacheblend@0.3", "epic@0.15", "fusionrag@0.15")


@dataclass(frozen=True)
class Timer:
    """Where the rows are timed, and how many timed runs each measurement takes (the shape's)."""
    device: torch.device
    repeats: int

    def seconds(self, fn: Callable[[], object]) -> float:
        """The median of `repeats` runs of `fn`, after a warm-up (kernels chosen, pools filled)."""
        fn()
        return median([timed(fn, self.device) for _ in range(self.repeats)])

    def ms(self, fn: Callable[[], object]) -> float:
        return 1e3 * self.seconds(fn)


def release_all(outs) -> None:
    for out in outs:
        out.cache.release()



def direct_row(runner: BatchRunner, req, plan, full_ms: float | None, timer: Timer) -> dict:
    """`plan` on chunk KV already on the device, graphs on (replayed where the runner replays it),
    then eager (graphs off), then replayed even where the runner would not (`forced_ms`: the rule
    that sends device-bound runs eager, `GraphPrefill.is_launch_bound`, graded), and the replayed
    and eager logits apart."""
    replays = runner.graphs.num_replays
    ms = timer.ms(lambda: release_all(runner.run([req], plan)))
    is_graphed = runner.graphs.num_replays > replays
    graphs, rule = runner.graphs, runner.graphs.max_row_params
    runner.model.is_prefill_graphed = False
    try:
        eager_ms = timer.ms(lambda: release_all(runner.run([req], plan)))
        eager = runner.run([req], plan)
        runner.model.is_prefill_graphed, graphs.max_row_params = True, 1 << 62
        forced_ms = timer.ms(lambda: release_all(runner.run([req], plan)))
        graphed = runner.run([req], plan)
    finally:
        runner.model.is_prefill_graphed, graphs.max_row_params = True, rule
    diff = (graphed[0].logits - eager[0].logits).abs().max().item()
    release_all(graphed + eager)
    return {"ms": ms, "full_prefill_ms": full_ms, "ratio": ms / full_ms if full_ms else None, "is_graphed": is_graphed,
            "eager_ms": eager_ms, "eager_ratio": eager_ms / full_ms if full_ms else None, "forced_ms": forced_ms,
            "logit_diff_vs_eager": diff}


def stage_store(model: Decoder, req) -> tuple:
    """The request's chunks put in a memory-tier store (sized to hold them), the transfer engine
    over it and the keyed request: what serving stages a batch from."""
    from cachesmith.kvstore import ChunkStore, StoreConfig, TransferEngine, put_prompt

    num_bytes = sum(c.keys.numel() + c.values.numel() for c in req.chunks) * req.chunks[0].keys.element_size()
    store = ChunkStore(StoreConfig(tiers=("memory",), memory_bytes=2 * num_bytes + (64 << 20)))
    keyed = put_prompt(store, req.chunks, req.suffix_ids)
    return store, TransferEngine(store, model), keyed, num_bytes


def store_row(runner: BatchRunner, engine, keyed, req, plan, full_ms: float | None, timer: Timer) -> dict:
    """`plan` staged from the store, and its logits against the direct path's (the store->device
    copy must change nothing)."""
    def run():
        with engine.stage([keyed], plan) as staged:
            outs = runner.run(staged.requests, plan, staged)
            logits = outs[0].logits.clone()
        release_all(outs)
        return logits
    direct = runner.run([req], plan)
    diff = (run() - direct[0].logits).abs().max().item()
    release_all(direct)
    ms = timer.ms(run)
    return {"ms": ms, "full_prefill_ms": full_ms, "ratio": ms / full_ms if full_ms else None,
            "logit_diff_vs_direct": diff}


def method_rows(rows, clock, reserve_s, model, runner, req, context: int, full_ms, timer: Timer) -> None:
    """Each method at one context: direct, then through the store (set up once for all four)."""
    staged: dict = {}

    def setup():
        start = time.perf_counter()
        staged["store"], staged["engine"], staged["keyed"], num_bytes = stage_store(model, req)
        return {"context_tokens": context, "stored_gb": num_bytes / 1e9, "put_s": time.perf_counter() - start}
    guarded(rows, clock, "setup", f"store {context}", setup, reserve_s)
    try:
        for name in METHODS:
            plan = parse_method(name).plan(model.num_layers)
            common = {"context_tokens": context, "method": name}
            guarded(rows, clock, "reuse", f"{name} {context} direct",
                    lambda: {**common, "path": "direct", **direct_row(runner, req, plan, full_ms, timer)}, reserve_s)
            guarded(rows, clock, "reuse", f"{name} {context} store",
                    lambda: {**common, "path": "store", **(store_row(runner, staged["engine"], staged["keyed"], req,
                             plan, full_ms, timer) if "keyed" in staged else {"skipped": "the store's setup failed"})},
                    reserve_s)
    finally:
        if "engine" in staged:
            staged["engine"].close()
            staged["store"].close()
