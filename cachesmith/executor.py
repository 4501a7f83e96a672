"""Runs one scheduled batch on the model: the runtime side of the serving loop (paper §5.3).

In: a `ScheduleDecision` and the `Request`s it names (their stored prompts: chunk keys and token
counts). Out: a `BatchExecution` from `prefill`: the measured batch TTFT (staging, transfer waits,
layer 0, the plan decided after it, the recompute, the first tokens), transfer stall, the plan and
per request its first-token logits and assembled KV; then `decode` turns those into answers (greedy
or sampled, as each request's `SamplingParams` say)
(after the clock stopped, and on another thread when serving live), reporting each token to an
optional `on_token(request_id, index, token_id)` hook as it is produced.
"planned" batches ask the planner for (S, w, p, r) after layer 0, from the layer-0 QCI entropies,
under the decision's budget, and run with the runtime monitor; "static" and "full_reuse" batches
run the decision's plan. Never touches queues.

On CUDA a batch's prefill runs on a stream of its own, so decode steps (launched from another
thread on the default stream) do not queue behind it; each generation carries the event its first
token was chosen at, which decoding waits for on the device before reading its cache.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from cachesmith.errors import InputError
from cachesmith.model import Decoding, Generation
from cachesmith.model import device as accel
from cachesmith.model.generate import start_generation
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import BatchPlan, BatchShape, Planner, PlanRequest
from cachesmith.planner.monitor import RuntimeMonitor
from cachesmith.recompute import HookChain, RecomputeConfig, RecomputeOutput, Signal
from cachesmith.request import Request
from cachesmith.scheduler import QueuedRequest, ScheduleDecision

# stages nothing beyond layer 0: the real plan (and what it loads) is decided there
PROVISIONAL = RecomputeConfig(Signal.POSITION, 1, 0, 0.0)
TAIL_WINDOW = 8  # recent batches whose tail (last layer to first tokens) the monitor reserves


def queued_view(request: Request, prefix: int, context: int, suffix: int,
                kv_capacity_tokens: int | None = None, view: QueuedRequest | None = None) -> QueuedRequest:
    """The scheduler's view of a request of these token counts (`view`: the one its caller made,
    checked against them); with `kv_capacity_tokens`, an `InputError` if it cannot run even alone
    (the engine's own limit: the rules of every request were checked where it entered,
    `cachesmith.request`)."""
    total = prefix + context + suffix
    if kv_capacity_tokens is not None and total > kv_capacity_tokens:
        raise InputError(f"request {request.request_id}: context of {total} tokens exceeds the KV capacity of "
                         f"{kv_capacity_tokens} tokens (scheduler.kv_capacity_tokens) even alone")
    if view is None:
        return QueuedRequest(request.request_id, request.arrival_s, request.slo_s, context, suffix, prefix)
    if (view.request_id, view.counts()) != (request.request_id, (context, suffix, prefix)):
        raise ValueError(f"request {request.request_id}: its view (request {view.request_id}, counts "
                         f"{view.counts()}) is not of its prompt ({(context, suffix, prefix)})")
    return view


def prompt_counts(request: Request) -> tuple[int, int, int]:
    """A stored prompt's (context, suffix, prefix) token counts."""
    p = request.prompt
    return p.num_context_tokens, len(p.suffix_ids), p.num_prefix_tokens


TokenHook = Callable[[int, int, int], None]  # (request id, token index, token id)


@dataclass(frozen=True)
class RequestOutput:
    answer: str
    coverage: float
    num_context_tokens: int
    num_recomputed: int
    qci_entropy: float | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    is_passed: bool | None = None  # the runtime's own verdict (the simulator's); None: gate the answer
    num_cached_prefix: int = 0
    reused_by_chunk: tuple[int, ...] = ()
    logprobs: list | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BatchExecution:
    outs: list[RecomputeOutput]  # first-token logits and assembled KV, per request
    coverages: list[float]  # per request, as planned
    seconds: float  # staging to the last first token: the batch's TTFT
    stall_s: float  # time the runner waited on KV transfer
    plan_label: str
    plan: BatchPlan | None = None  # "planned" batches
    num_monitor_replans: int = 0
    verdicts: list[bool] | None = None  # the simulator's gate verdicts (it has no outputs)
    final_coverages: list[float] | None = None  # the simulator's, after its monitor (None: as planned)

    @property
    def planner_s(self) -> float:
        """The planner's decision time (inside `seconds`; staging the plan is not in it)."""
        return self.plan.decision_s if self.plan else 0.0


class Executor(Protocol):
    """Runs batches for the `Engine`: the model's `BatchExecutor` or the simulator's."""

    def admit(self, request: Request, kv_capacity_tokens: int, view: QueuedRequest | None = None) -> QueuedRequest: ...

    def prefill(self, decision: ScheduleDecision, batch: list[Request]) -> BatchExecution: ...

    def decode(self, batch: list[Request], run: BatchExecution,
               on_token: TokenHook | None = None) -> list[RequestOutput]: ...


class BatchExecutor:
    def __init__(self, pipeline: RagPipeline, planner: Planner | None = None) -> None:
        self.pipeline, self.planner = pipeline, planner
        # seconds from the last layer's end to the first tokens of recent planned batches: the
        # runtime monitor keeps the largest of them clear of the deadline
        self.tails_s: deque[float] = deque(maxlen=TAIL_WINDOW)
        self._decoding: Decoding | None = None  # `decode`'s, kept across batches
        self._stream = accel.new_stream(pipeline.model.device)  # prefill's (inert on the CPU)

    def admit(self, request: Request, kv_capacity_tokens: int, view: QueuedRequest | None = None) -> QueuedRequest:
        """The scheduler's view of a request whose caller keyed and stored its prompt (it runs with
        the keys it gave; `view`: the caller's, made at its arrival), or an `InputError` naming the
        engine limit it breaks."""
        if request.prompt is None:
            raise InputError(f"request {request.request_id}: no stored prompt (build it with "
                             f"RagPipeline.request or RagPipeline.stored_prompt)")
        context, suffix, prefix = prompt_counts(request)
        return queued_view(request, prefix, context, suffix, kv_capacity_tokens, view)

    def prefill(self, decision: ScheduleDecision, batch: list[Request]) -> BatchExecution:
        """Run the batch up to its first tokens (the timed part), on the prefill stream."""
        with accel.on_stream(self._stream):
            return self._prefill(decision, batch)

    def _prefill(self, decision: ScheduleDecision, batch: list[Request]) -> BatchExecution:
        if decision.mode != "planned":
            plan = replace(decision.static_plan, coverage=decision.coverage)
            outs, seconds, stall = self._timed_run(batch, plan)
            return BatchExecution(outs, [decision.coverage] * len(batch), seconds, stall, plan.label())
        if self.planner is None:
            raise ValueError("a planned batch needs the executor's planner")
        decided: dict = {}
        outs, seconds, stall = self._timed_run(batch, PROVISIONAL, self._replanner(decision, batch, decided))
        plan, monitor = decided["plan"], decided["monitor"]
        if monitor.walk_s is not None:
            self.tails_s.append(max(0.0, seconds - monitor.walk_s))
        if monitor.pace is not None:  # pace is relative to the corrected schedule
            self.planner.observe(plan.signal, monitor.time_scale * monitor.pace, plan.probe,
                                 monitor.shape.num_tokens)
        return BatchExecution(outs, list(plan.coverages), seconds, stall, plan.recompute_config().label(), plan,
                              monitor.num_replans)

    def _timed_run(self, batch: list[Request], plan: RecomputeConfig, replanner=None):
        """(outputs, seconds from staging to the first tokens, transfer stall seconds)."""
        guard = self.pipeline.batch_guard
        with guard() if guard is not None else nullcontext():  # a benchmark's wait, off the clock
            start = time.perf_counter()
            with self.pipeline.transfer.stage([r.prompt for r in batch], plan,
                                              [r.max_new_tokens for r in batch]) as staged:
                hooks = HookChain(staged)
                replan = None if replanner is None else (lambda h: replanner(h, staged, hooks, start))
                outs = self.pipeline.runner.run(staged.requests, plan, hooks, replan=replan)
                for out in outs:
                    out.first_token  # reading the argmax synchronizes with the device
                return outs, time.perf_counter() - start, staged.stall_s

    def _replanner(self, decision: ScheduleDecision, batch: list[Request], decided: dict):
        """The runner's `replan` after layer 0: plan from the real entropies under the decision's
        budget, stage what the plan reads, and join the runtime monitor to the layer hooks."""
        planner = self.planner
        counts = [prompt_counts(r) for r in batch]  # (context, suffix, prefix)
        shape = BatchShape(*(tuple(c[i] for c in counts) for i in range(3)))  # the same three, per request

        def replan(entropies, staged, hooks: HookChain, start: float):
            reqs = [PlanRequest(*c, e, r.task) for c, r, e in zip(counts, batch, entropies)]
            plan = planner.plan(reqs, decision.budget_s)
            config = plan.recompute_config()
            staged.set_plan(config)
            monitor = RuntimeMonitor(plan, planner.cost, shape, steps_done=1,
                                     time_scale=planner.pace(plan.signal, plan.probe, shape.num_tokens),
                                     limit_s=decision.limit_s, tail_s=max(self.tails_s, default=0.0))
            monitor.start(at=start)
            hooks.hooks.append(monitor)
            decided.update(plan=plan, monitor=monitor)
            return config, list(plan.coverages)

        return replan

    def decode(self, batch: list[Request], run: BatchExecution,
               on_token: TokenHook | None = None) -> list[RequestOutput]:
        """Answers from the prefilled batch, its requests decoded together (off the TTFT clock)."""
        if self._decoding is None:  # one for every batch: its graph buckets are captured once
            self._decoding = Decoding(self.pipeline.model)
        decoding = self._decoding
        gens = self.start_decoding(batch, run, on_token)
        for gen in gens:
            decoding.add(gen)
        decoding.run()
        return [self.output(req, run, i, gen) for i, (req, gen) in enumerate(zip(batch, gens))]

    def start_decoding(self, batch: list[Request], run: BatchExecution,
                       on_token: TokenHook | None = None) -> list[Generation]:
        """Each request's first token chosen now (it may be sampled); the rest come from a
        `Decoding`'s steps. A generation's `tag` is its request's index in the batch."""
        gens = []
        with accel.on_stream(self._stream):
            for i, (req, out) in enumerate(zip(batch, run.outs)):
                rid = req.request_id
                hook = None if on_token is None else (lambda j, t, rid=rid: on_token(rid, j, t))
                gens.append(start_generation(self.pipeline.model, out.logits, out.cache,
                                             req.max_new_tokens, req.sampling, hook, i))
            prefilled = accel.new_event(self.pipeline.model.device)
            prefilled.record()
        for gen in gens:
            gen.prefilled = prefilled
        return gens

    def output(self, req: Request, run: BatchExecution, index: int, gen: Generation) -> RequestOutput:
        """A finished generation's answer; its cache's slabs go back to the pool for the next batch."""
        out, p = run.outs[index], req.prompt
        out.cache.release()
        asked = req.sampling.num_logprobs is not None
        return RequestOutput(self.pipeline.tokenizer.decode(gen.token_ids).strip(), float(run.coverages[index]),
                             out.num_context, int(out.selected.numel()), out.qci_entropy,
                             p.num_tokens, len(gen.token_ids), num_cached_prefix=p.num_prefix_tokens,
                             reused_by_chunk=reused_by_chunk(p.chunk_num_tokens, out.selected),
                             logprobs=list(gen.logprobs) if asked else None, token_ids=tuple(gen.token_ids))


def reused_by_chunk(chunk_tokens: tuple[int, ...], selected) -> tuple[int, ...]:
    """Per chunk, its rows not recomputed: chunk lengths less the recomputed context indices
    (`selected`, sorted, over the concatenated context) that fall in it."""
    ends = np.cumsum(chunk_tokens)
    recomputed = np.bincount(np.searchsorted(ends, np.asarray(selected), side="right"),
                             minlength=len(chunk_tokens))[:len(chunk_tokens)]
    return tuple(int(n - r) for n, r in zip(chunk_tokens, recomputed))
