"""The engine on the live clock behind a thread-safe front: what a server talks to.

In: `submit(instance, slo_s)` from any thread. Out: a `Future` resolving to the request's
`RequestResult` (refused ones at once, with their error). A background thread runs batch after
batch while the queue is not empty; admissions (tokenizing, prefilling missing chunk KV) run in
the caller's thread, one at a time, so they never hold up scheduling. A queue limit answers
`QueueFull` with a retry-after estimate; `close()` stops admissions and drains what is queued.
A batch that raises turns into per-request errors; the loop keeps serving.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
from concurrent.futures import Future

from cachesmith.engine import Engine
from cachesmith.errors import CachesmithError, ConfigError, InputError
from cachesmith.request import Request, RequestResult
from cachesmith.workloads.instance import WorkloadInstance

log = logging.getLogger(__name__)


class QueueFull(CachesmithError):
    def __init__(self, depth: int, limit: int, retry_after_s: float) -> None:
        super().__init__(f"queue is full ({depth} requests waiting, max_queue={limit}); "
                         f"retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class EngineClosed(CachesmithError):
    """The loop is shutting down and takes no new requests."""


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        if engine.clock.name != "live":
            raise ConfigError(f"EngineLoop needs the live clock, the engine has {engine.clock.name!r}")
        if max_queue < 1:
            raise ConfigError(f"max_queue={max_queue} must be >= 1")
        self.engine, self.max_queue = engine, max_queue
        self._cond = threading.Condition()
        self._admit_lock = threading.Lock()  # the store and tokenizer see one admission at a time
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._num_admitting = 0
        self._is_closing = False
        self._thread = threading.Thread(target=self._loop, name="cachesmith-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self.engine.queue_depth + self._num_admitting

    def retry_after_s(self) -> float:
        """Time for the queue ahead to drain, from the mean batch time so far (1 s before any)."""
        st = self.engine.stats
        per_batch = st.busy_s / st.num_batches if st.num_batches else 1.0
        return per_batch * math.ceil(max(1, self.engine.queue_depth) / self.engine.config.scheduler.max_batch_size)

    def submit(self, instance: WorkloadInstance, slo_s: float) -> Future:
        with self._cond:
            if self._is_closing:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            depth = self.queue_depth  # the condition's lock is reentrant
            if depth >= self.max_queue:
                raise QueueFull(depth, self.max_queue, self.retry_after_s())
            self._num_admitting += 1
            request = Request(next(self._ids), instance, slo_s, self.engine.clock.now())
        future: Future = Future()
        try:
            with self._admit_lock:
                admitted = self.engine.admit(request)
        except InputError as exc:
            future.set_result(RequestResult.refused(request, str(exc)))
            admitted = None
        with self._cond:
            self._num_admitting -= 1
            if admitted is not None:
                self._futures[request.request_id] = future
                self.engine.submit(admitted)
            self._cond.notify_all()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self.engine.queue_depth == 0 and not (self._is_closing and self._num_admitting == 0):
                    self._cond.wait()
                if self.engine.queue_depth == 0:
                    return  # closing, and nothing left to serve
                decided = self.engine.next_decision()
            if decided is None:
                continue
            decision, batch = decided
            try:
                results = self.engine.run_batch(decision, batch)
            except Exception as exc:  # a bad batch must not take the server down with it
                log.exception("batch %s failed", decision.request_ids)
                results = [RequestResult.refused(a.request, f"internal error while serving: {exc}") for a in batch]
            with self._cond:
                for res in results:
                    self._futures.pop(res.request_id).set_result(res)

    def close(self, timeout: float | None = None) -> bool:
        """Stop admissions, serve everything queued, stop the thread. True if it drained in time."""
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
