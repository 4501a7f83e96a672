"""The engine on the live clock behind a thread-safe front: what a server talks to.

In: `submit(instance, slo_s, on_token)` from any thread. Out: a `Future` resolving to the
request's `RequestResult` (refused ones at once, with their error), and `on_token(index, token_id)`
calls as tokens are produced: the first token as soon as its batch's prefill ends, the rest while
decoding. The prefill thread runs batch after batch while the queue is not empty and hands each
finished batch to a decode thread (prefill-decode disaggregation, DESIGN.md §5), so decoding one
batch never delays the next batch's first tokens (`is_decode_overlapped=False` decodes on the
prefill thread instead). Admissions (tokenizing, prefilling missing chunk KV) run in the caller's
thread, one at a time, so they never hold up scheduling. A queue limit answers `QueueFull` with a
retry-after estimate; `cancel` drops a request still queued; `close()` stops admissions and drains
what is queued. A batch that raises turns into per-request errors; the loop keeps serving.
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from cachesmith.engine import Engine, PrefilledBatch
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
    def __init__(self, engine: Engine, max_queue: int = 64, is_decode_overlapped: bool = True) -> None:
        if engine.clock.name != "live":
            raise ConfigError(f"EngineLoop needs the live clock, the engine has {engine.clock.name!r}")
        if max_queue < 1:
            raise ConfigError(f"max_queue={max_queue} must be >= 1")
        # False: decode each batch on the prefill thread before the next batch (no core sharing)
        self.engine, self.max_queue, self.is_decode_overlapped = engine, max_queue, is_decode_overlapped
        self._cond = threading.Condition()
        self._admit_lock = threading.Lock()  # the store and tokenizer see one admission at a time
        self._futures: dict[int, Future] = {}
        self._sinks: dict[int, Callable[[int, int], None]] = {}
        self._ids = itertools.count()
        self._num_admitting = 0
        self._is_closing = False
        self._stop_ids = set(engine.pipeline.model.config.eos_token_ids)
        self._prefilled: queue.Queue[PrefilledBatch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="cachesmith-prefill", daemon=True)
        self._decoder = threading.Thread(target=self._decode_loop, name="cachesmith-decode", daemon=True)
        self._thread.start()
        self._decoder.start()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self.engine.queue_depth + self._num_admitting

    def retry_after_s(self) -> float:
        """Time for the queue ahead to drain, from the mean batch time so far (1 s before any)."""
        st = self.engine.stats
        per_batch = st.busy_s / st.num_batches if st.num_batches else 1.0
        return per_batch * math.ceil(max(1, self.engine.queue_depth) / self.engine.config.scheduler.max_batch_size)

    @property
    def is_closing(self) -> bool:
        return self._is_closing

    def admission(self) -> threading.Lock:
        """The lock admissions hold; hold it too to write the store beside the loop."""
        return self._admit_lock

    def check_capacity(self) -> None:
        """Raise `EngineClosed` or `QueueFull` now, before a caller does costly work for a request."""
        with self._cond:
            if self._is_closing:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            depth = self.queue_depth  # the condition's lock is reentrant
            if depth >= self.max_queue:
                raise QueueFull(depth, self.max_queue, self.retry_after_s())

    def submit(self, instance: WorkloadInstance, slo_s: float,
               on_token: Callable[[int, int], None] | None = None, arrival_s: float | None = None) -> Future:
        """Queue a request; `arrival_s` (default now, on the engine's clock) starts its TTFT."""
        with self._cond:
            self.check_capacity()
            self._num_admitting += 1
            arrival = self.engine.clock.now() if arrival_s is None else arrival_s
            request = Request(next(self._ids), instance, slo_s, arrival)
        future: Future = Future()
        future.request_id = request.request_id  # what `cancel` takes
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
                if on_token is not None:
                    self._sinks[request.request_id] = on_token
                self.engine.submit(admitted)
            self._cond.notify_all()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self.engine.queue_depth == 0 and not (self._is_closing and self._num_admitting == 0):
                    self._cond.wait()
                if self.engine.queue_depth == 0:
                    self._prefilled.put(None)  # closing, and nothing left to serve
                    return
                decided = self.engine.next_decision()
            if decided is None:
                continue
            decision, batch = decided
            try:
                prefilled = self.engine.prefill_batch(decision, batch)
            except Exception as exc:  # a bad batch must not take the server down with it
                log.exception("batch %s failed", decision.request_ids)
                self._resolve([RequestResult.failed(a.request, f"internal error while serving: {exc}")
                               for a in batch])
                continue
            for rid, token in prefilled.first_tokens():
                if token not in self._stop_ids:
                    self._emit(rid, 0, token)
            if self.is_decode_overlapped:
                self._prefilled.put(prefilled)
            else:
                self._finish(prefilled)

    def cancel(self, request_id: int) -> bool:
        """Drop a request still waiting in the queue (a client that went away): its future resolves
        with a "cancelled" result. False if it is already running or done."""
        with self._cond:
            admitted = self.engine.cancel(request_id)
            if admitted is None:
                return False
        self._resolve([RequestResult.refused(admitted.request, "cancelled before it was scheduled", "cancelled")])
        return True

    def _decode_loop(self) -> None:
        while (prefilled := self._prefilled.get()) is not None:
            self._finish(prefilled)

    def _finish(self, prefilled: PrefilledBatch) -> None:
        try:
            results = self.engine.finish_batch(prefilled, self._emit_later)
        except Exception as exc:
            log.exception("decoding batch %s failed", prefilled.batch_id)
            results = [RequestResult.failed(a.request, f"internal error while decoding: {exc}")
                       for a in prefilled.batch]
        self._resolve(results)

    def _emit(self, request_id: int, index: int, token_id: int) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink(index, token_id)
        except Exception:  # a consumer's failure (a client gone) must not stop the others
            log.exception("token sink of request %d failed; it gets no more tokens", request_id)
            self._sinks.pop(request_id, None)

    def _emit_later(self, request_id: int, index: int, token_id: int) -> None:
        if index > 0:  # the first token went out when the prefill ended
            self._emit(request_id, index, token_id)

    def _resolve(self, results: list[RequestResult]) -> None:
        with self._cond:
            for res in results:
                self._sinks.pop(res.request_id, None)
                self._futures.pop(res.request_id).set_result(res)

    def close(self, timeout: float | None = None) -> bool:
        """Stop admissions, serve everything queued, stop the thread. True if it drained in time."""
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(timeout)
        self._decoder.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not (self._thread.is_alive() or self._decoder.is_alive())
