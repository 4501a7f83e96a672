"""The vLLM connector's worker side: builds run inside vLLM's step, or on one builder thread.

In: the `Load`s of each step's metadata and a build function (the connector's: cachesmith builds
the prompt's KV and writes it into the load's blocks, returning a `Built`). Out, once per step
(`drain`): the reports of the builds that ended (for the scheduler), their counters (for vLLM's
stats), the blocks of builds that failed (vLLM's load errors: it recomputes them) and, for
asynchronous builds, the requests whose load ended (vLLM's finished receiving). Free of vLLM, so
`make test` covers it with fake builds.

Synchronous (`load_async=False`): `start` builds every load before it returns, and vLLM's forward
of that step waits. Asynchronous: `start` queues the loads on one thread and returns; vLLM keeps
the request waiting for its KV and keeps stepping the others until `drain` names it as received.
One thread, so builds never run the worker's pipeline concurrently.

A rebuild (the request was preempted and resumed) runs the plan its first build ran, kept per
request until vLLM says it finished: the rows it writes are the rows the request's earlier tokens
were decoded from, even where the planner would now choose differently (less of the SLO is left).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from cachesmith.integrations.connector_book import Load
from cachesmith.integrations.prompt_kv import PARAMS_KEY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Built:
    """What one successful build returns."""
    params: dict  # the request's report, for its response's kv_transfer_params
    counts: dict[str, int]  # stats keys -> counts (`vllm_stats.SERIES`)
    plan: Any  # the plan it ran (`prompt_kv.PromptPlan`), for a rebuild


@dataclass(frozen=True)
class Outcome:
    load: Load
    built: Built | None  # None: the build failed
    error: str = ""


@dataclass
class StepResults:
    """What the worker hands vLLM after one step."""
    reports: dict[str, dict] = field(default_factory=dict)  # request id -> its report
    counts: list[dict[str, int]] = field(default_factory=list)
    failed_blocks: set[int] = field(default_factory=set)
    received: set[str] = field(default_factory=set)  # asynchronous loads that ended, built or not


BuildFn = Callable[[Load, Any], Built]  # (load, the plan of its earlier build or None) -> Built


class Builds:
    def __init__(self, build: BuildFn, load_async: bool) -> None:
        self._build, self.load_async = build, load_async
        self._ended: list[Outcome] = []  # synchronous builds of this step
        self._running: dict[str, Future] = {}  # asynchronous builds, by request id
        self._plans: dict[str, Any] = {}  # request id -> the plan its first build ran
        self._finished: set[str] = set()  # requests vLLM finished while their build ran
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cachesmith-build") if load_async else None

    def start(self, loads: Iterable[Load]) -> None:
        for load in loads:
            plan = self._plans.get(load.request_id) if load.num_rebuilds else None
            if self._pool is None:
                self._ended.append(self._run(load, plan))
            else:
                self._running[load.request_id] = self._pool.submit(self._run, load, plan)

    def _run(self, load: Load, plan: Any) -> Outcome:
        try:
            with torch.inference_mode():  # as vLLM's step runs; a thread of its own starts without it
                return Outcome(load, self._build(load, plan))
        except Exception as exc:  # noqa: BLE001  any failure: vLLM prefills, never a wrong answer
            log.warning("request %s: cachesmith could not build its KV (%s: %s); vLLM prefills it",
                        load.request_id, type(exc).__name__, exc)
            return Outcome(load, None, f"{type(exc).__name__}: {exc}")

    def drain(self, finished_req_ids: Iterable[str] = ()) -> StepResults:
        """The builds that ended since the last drain; forgets the plans of finished requests."""
        for request_id in finished_req_ids:
            self._plans.pop(request_id, None)
            if request_id in self._running:
                self._finished.add(request_id)
        ended, self._ended = self._ended, []
        for request_id, future in list(self._running.items()):
            if future.done():
                ended.append(future.result())
                del self._running[request_id]
        results = StepResults()
        for outcome in ended:
            self._record(outcome, results)
        return results

    def _record(self, outcome: Outcome, results: StepResults) -> None:
        request_id = outcome.load.request_id
        if self._pool is not None:
            results.received.add(request_id)
        if outcome.built is None:
            results.failed_blocks.update(outcome.load.block_ids)
            results.counts.append({"prompts_fallback": 1})
            results.reports[request_id] = {PARAMS_KEY: {"error": outcome.error, "fallback": "vllm_prefill"}}
        else:
            results.counts.append(outcome.built.counts)
            results.reports[request_id] = outcome.built.params
            if request_id not in self._finished:
                self._plans[request_id] = outcome.built.plan
        self._finished.discard(request_id)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
