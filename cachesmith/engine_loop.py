"""The engine on the live clock behind a thread-safe front: what a server talks to.

In: `submit(request, on_token)` from any thread: a `Request` whose prompt its caller keyed and
stored, built in its queue place (`reserve().request(...)`). Out: a `RequestFuture` resolving to
the request's `RequestResult` (refused ones at once, with their error), and
`on_token(index, token_id)` calls as tokens are produced: the first token as soon as its batch's
prefill ends, the rest while decoding. The prefill thread runs batch after batch
while the queue is not empty and hands each finished batch's sequences to a decode thread
(prefill-decode disaggregation). The decode thread steps every decoding sequence together
(continuous batching: sequences join and leave between steps) and starts no step while a prefill
batch runs, so the TTFT SLOs keep the cores; only when `max_decoding` sequences wait does decoding
run beside prefill, and the prefill thread then waits for room before its next batch (memory stays
bounded). `is_decode_overlapped=False` decodes each batch whole on the prefill thread instead. The
caller keys and stores a request's prompt first (under `admission()`, so the store sees one writer
at a time) and its admission, which checks its limits, runs in the caller's thread too: neither
holds up scheduling. A request holds a place in the queue from the moment it is accepted (`reserve`,
before any costly work for it) until it is queued or refused: beyond `max_queue` places a
`QueueFull` with a retry-after estimate answers at once. With shedding on (`SheddingConfig`), the
caller prices each request against the work ahead before any of its documents is prefilled
(`check_deadline`, `SloUnattainable` when it is not feasible at the margin), and at each batch
boundary a queued request no longer feasible is answered refused instead of run
(`cachesmith.shedding`). An admission that raises (any exception)
resolves its future with an internal error and gives its place back. `cancel` drops a request still
queued; `close()` stops admissions and drains what is queued. A batch that raises turns into
per-request errors; the loop keeps serving. Served results carry each token's clock time (for
end-to-end and inter-token latency).
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from cachesmith.engine import Engine, PrefilledBatch
from cachesmith.errors import ConfigError, InputError
from cachesmith.model import Generation
from cachesmith.queue_places import AdmissionTurns, EngineClosed, QueueFull, RequestFuture, Slot
from cachesmith.request import Request, RequestResult
from cachesmith.scheduler import QueuedRequest
from cachesmith.scheduler.feasibility import DeadlinePricer, PromptSize, SheddingConfig, TtftEstimate
from cachesmith.shedding import SHED_KIND, DeadlineAdmission
from cachesmith.token_streams import TokenSink, TokenStreams

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int = 64, is_decode_overlapped: bool = True,
                 max_decoding: int = 64, shedding: SheddingConfig = SheddingConfig(None)) -> None:
        if engine.clock.name != "live":
            raise ConfigError(f"EngineLoop needs the live clock, the engine has {engine.clock.name!r}")
        if max_queue < 1 or max_decoding < 1:
            raise ConfigError(f"max_queue={max_queue} and max_decoding={max_decoding} must be >= 1")
        # False: decode each batch on the prefill thread before the next batch (no core sharing)
        self.engine, self.max_queue, self.is_decode_overlapped = engine, max_queue, is_decode_overlapped
        self.max_decoding = max_decoding
        pricer = DeadlinePricer(engine.planner, engine.config.scheduler.max_batch_size)
        self.deadlines = DeadlineAdmission(pricer, shedding)
        self.num_shed_queued = 0  # queued requests answered refused: no longer feasible at the margin
        self._cond = threading.Condition()
        self._admit_lock = AdmissionTurns()  # the store and tokenizer see one admission at a time, in turn
        self._futures: dict[int, Future] = {}
        self._streams = TokenStreams(engine.clock)
        self._ids = itertools.count()
        self._num_admitting = 0
        self._is_closing = False
        self._decoding = engine.new_decoding()  # the decode thread's sequences
        self._handed: list[Generation] = []  # started on the prefill thread, not yet joined
        self._num_decoding = 0  # handed + active, read by the prefill thread for room
        self._num_in_batch = 0  # the batch the prefill thread holds (prefilling, or decoding it whole)
        self._is_prefilling = False
        self._is_prefill_done = False
        # hears "prefill <num decoding>", "prefilled" and "step <num sequences>" as they happen, under
        # the loop's lock
        self.trace: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="cachesmith-prefill", daemon=True)
        self._decoder = threading.Thread(target=self._decode_loop, name="cachesmith-decode", daemon=True)
        self._thread.start()
        self._decoder.start()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self.engine.queue_depth + self._num_admitting

    @property
    def num_running(self) -> int:
        """Requests out of the queue and not yet answered: in the batch being prefilled (or decoded
        whole) and those decoding."""
        with self._cond:
            return self._num_in_batch + self._num_decoding

    def retry_after_s(self) -> float:
        """Time for the queue ahead (queued and being admitted) to drain, from the mean batch time so
        far (1 s before any)."""
        st = self.engine.stats
        per_batch = st.busy_s / st.num_batches if st.num_batches else 1.0
        return per_batch * math.ceil(max(1, self.queue_depth) / self.engine.config.scheduler.max_batch_size)

    @property
    def is_closing(self) -> bool:
        return self._is_closing

    def admission(self) -> AdmissionTurns:
        """The turns admissions take, first come first served (reentrant); take one too to write
        the store beside the loop."""
        return self._admit_lock

    def reserve(self) -> Slot:
        """A place in the queue for a request about to be admitted, taken before any costly work for
        it (tokenizing, prefilling its chunks). Raises `EngineClosed`, or `QueueFull` when
        `max_queue` requests are queued or being admitted."""
        with self._cond:
            if self._is_closing:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            depth = self.queue_depth  # the condition's lock is reentrant
            if depth >= self.max_queue:
                raise QueueFull(depth, self.max_queue, self.retry_after_s())
            self._num_admitting += 1
            return Slot(self._give_back, next(self._ids), self.engine.clock.now())

    def check_deadline(self, slot: Slot, num_new_tokens: list[int]) -> TtftEstimate | None:
        """Before any of its documents is prefilled: `SloUnattainable` when the request in `slot`
        (its view measured, its documents not yet stored) is not feasible at the shedding margin;
        else its work is counted ahead of later arrivals until it is queued (its estimate; None with
        shedding off)."""
        with self._cond:
            return self.deadlines.admit(slot.view, self.engine.clock.now(), self.engine.queued_views(), num_new_tokens)

    def check_arrival(self, slot: Slot, slo_s: float, size: PromptSize) -> None:
        """Before any work for the request in `slot`: its view (`slot.view`), sized from its text,
        and `SloUnattainable` when it is not feasible at the shedding margin of `slo_s`."""
        slot.view = self.deadlines.pricer.guessed(slot.request_id, slot.arrival_s, slo_s, size)
        with self._cond:
            self.deadlines.check_arrival(slot.view, self.engine.clock.now(), self.engine.queued_views(), size)

    def _give_back(self, slot: Slot) -> bool:
        """Caller may hold the condition. Give `slot` back, once: False if it was already."""
        with self._cond:
            if slot.is_released:
                return False
            slot.is_released = True
            self._num_admitting -= 1
            self.deadlines.settle(slot.request_id, self.engine.clock.now())
            self._cond.notify_all()
            return True

    def _enqueue(self, slot: Slot, request: Request, view: QueuedRequest, future: RequestFuture,
                 on_token: TokenSink | None) -> None:
        """Queue an admitted request and give its slot back in one step, so the depth never dips."""
        with self._cond:
            if not self._give_back(slot):
                raise RuntimeError(f"request {request.request_id}: its queue place was given back before it was queued")
            refused = self.engine.enqueue(request, view)
            if refused is not None:  # its id is queued already
                future.set_result(refused)
                return
            self._futures[request.request_id] = future
            self._streams.open(request.request_id, on_token)

    def submit(self, request: Request, on_token: TokenSink | None = None,
               slot: Slot | None = None) -> RequestFuture:
        """Queue `request` (its arrival starts its TTFT). `slot`: the place taken by `reserve` for
        it (default: one taken now); it is given back here, whatever happens. A request that
        breaks the engine's limits (`Engine.admit`) resolves refused."""
        slot = slot or self.reserve()
        try:
            future = RequestFuture(request.request_id)
            view = self._admit(request, future, slot.view)
            if view is not None:
                self._enqueue(slot, request, view, future, on_token)
        finally:
            slot.release()  # a no-op once queued; the one release on a refusal or an exception
        return future

    def _admit(self, request: Request, future: Future, view: QueuedRequest | None) -> QueuedRequest | None:
        """The scheduler's view of the request (`view`: made at its arrival), or None with `future`
        resolved: refused (`InputError`) or failed."""
        try:
            with self._admit_lock:
                return self.engine.admit(request, view)
        except InputError as exc:
            future.set_result(RequestResult.refused(request, str(exc)))
        except Exception as exc:  # the server's fault (a store read, memory): this request only
            log.exception("admitting request %d failed", request.request_id)
            future.set_result(RequestResult.failed(
                request, f"internal error while admitting the request: {type(exc).__name__}: {exc}"))
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._has_work() and not self._is_shadow_due():
                    self._cond.wait()
                is_shadow = not self._has_work()  # idle: one unit of shadow work, then look again
                if not is_shadow and self.engine.queue_depth == 0:  # closing, and nothing left to serve
                    self._is_prefill_done = True
                    self._cond.notify_all()
                    return
                shed, decided = ([], None) if is_shadow else self._decide()
            if shed:
                self._resolve(shed)
            if is_shadow:
                self._shadow_unit()
            elif decided is not None:
                self._prefill(*decided)

    def _decide(self) -> tuple[list[RequestResult], tuple | None]:
        """Caller holds the condition: the queued requests shed as no longer feasible, and the next
        batch (None: nothing to run now)."""
        queued = self.engine.queued_views()
        shed = self._take_expired(queued)
        decided = self.engine.next_decision()
        is_batch = decided is not None
        self._is_prefilling = is_batch
        self._num_in_batch = len(decided[1]) if is_batch else 0
        if is_batch:
            batch_ids = set(decided[0].request_ids)
            self.deadlines.start_batch([view for view in queued if view.request_id in batch_ids],
                                       self.engine.clock.now())
            self._note(f"prefill {self._num_decoding}")
        return shed, decided

    def _take_expired(self, queued: list[QueuedRequest]) -> list[RequestResult]:
        """Caller holds the condition: the queued requests no longer feasible at the shedding margin,
        taken off the queue and answered refused (their clients are told now, not served late)."""
        expired = self.deadlines.expired(queued, self.engine.clock.now())
        results = []
        for view, message in expired:
            request = self.engine.cancel(view.request_id)
            if request is not None:
                results.append(RequestResult.refused(request, message, SHED_KIND))
        self.num_shed_queued += len(results)
        return results

    def _is_shadow_due(self) -> bool:
        """Caller holds the condition: shadow work waits, and nothing is queued, admitted or decoding."""
        shadow = self.engine.shadow
        return (shadow is not None and shadow.has_work and not self._is_closing and self._num_admitting == 0
                and self._num_decoding == 0)

    def _shadow_unit(self) -> None:
        try:
            with self._admit_lock:  # it reads the store; an admission arriving now waits for this unit
                self.engine.shadow.run_idle(self.engine.clock)
        except Exception:  # shadow work must never take serving down: it stops instead
            log.exception("shadow calibration failed; it is switched off")
            self.engine.shadow = None

    def _has_work(self) -> bool:
        """Caller holds the condition: a batch to run (with room to decode it), or time to stop."""
        if self.engine.queue_depth == 0:
            return self._is_closing and self._num_admitting == 0
        return self._num_decoding < self.max_decoding or not self.is_decode_overlapped

    def _prefill(self, decision, batch) -> None:
        try:
            prefilled = self.engine.prefill_batch(decision, batch)
            gens = self.engine.start_decoding(prefilled, self._streams.emit)
        except Exception as exc:  # a bad batch must not take the server down with it
            log.exception("batch %s failed", decision.request_ids)
            self._resolve([RequestResult.failed(r, f"internal error while serving: {exc}") for r in batch])
            with self._cond:
                self._is_prefilling = False
                self._num_in_batch = 0
                self.deadlines.end_batch()
                self._note("prefilled")
                self._cond.notify_all()
            return
        for gen in gens:
            gen.tag = (prefilled, gen.tag)
        with self._cond:
            self._is_prefilling = False
            self.deadlines.end_batch()
            self._note("prefilled")
            if self.is_decode_overlapped:
                self._handed += gens
                self._num_decoding += len(gens)
                self._num_in_batch = 0  # counted as decoding from here
                self._cond.notify_all()
        if not self.is_decode_overlapped:
            self._finish_whole(prefilled, gens)
            with self._cond:
                self._num_in_batch = 0

    def cancel(self, request_id: int) -> bool:
        """Drop a request still waiting in the queue (a client that went away): its future resolves
        with a "cancelled" result. False if it is already running or done."""
        with self._cond:
            request = self.engine.cancel(request_id)
            if request is None:
                return False
        self._resolve([RequestResult.refused(request, "cancelled before it was scheduled", "cancelled")])
        return True

    def _decode_loop(self) -> None:
        """Step every decoding sequence together, between prefill batches."""
        while True:
            with self._cond:
                while not self._may_step():
                    if self._is_prefill_done and not self._handed and not self._decoding.active:
                        return
                    self._cond.wait()
                joining, self._handed = self._handed, []
                for gen in joining:
                    self._decoding.add(gen)
                if self._decoding.active:  # noted under the lock: ordered with prefill's events
                    self._note(f"step {len(self._decoding.active)}")
            finished = [g for g in joining if g.is_done]  # ended at their first token
            if self._decoding.active:
                finished += self._step()
            self._resolve(self._results(finished))
            with self._cond:
                self._num_decoding -= len(finished)
                self._cond.notify_all()

    def _may_step(self) -> bool:
        """Caller holds the condition: prefill runs first unless `max_decoding` sequences wait."""
        num_waiting = len(self._handed) + len(self._decoding.active)
        return num_waiting > 0 and (not self._is_prefilling or self._num_decoding >= self.max_decoding)

    def _step(self) -> list[Generation]:
        try:
            return self._decoding.step()
        except Exception as exc:  # fail these sequences, keep serving
            log.exception("decode step failed")
            failed, self._decoding.active = self._decoding.active, []
            for gen in failed:
                gen.error = f"internal error while decoding: {exc}"
            return failed

    def _results(self, gens: list[Generation]) -> list[RequestResult]:
        """Finished generations' results; their caches go back to the pool."""
        results = []
        for gen in gens:
            prefilled, index = gen.tag
            times = self._streams.take_times(prefilled.batch[index].request_id)
            results.append(self.engine.finish_one(prefilled, index, gen, times))
        return results

    def _finish_whole(self, prefilled: PrefilledBatch, gens: list[Generation]) -> None:
        """Decode a batch to its end on this thread (`is_decode_overlapped=False`)."""
        decoding = self._decoding  # the decode thread's, idle when batches decode whole here
        for gen in gens:
            decoding.add(gen)
        try:
            decoding.run()
        except Exception as exc:
            log.exception("decoding batch %s failed", prefilled.batch_id)
            for gen in gens:
                gen.error = f"internal error while decoding: {exc}"
        self._resolve(self._results(gens))

    def _note(self, event: str) -> None:
        if self.trace is not None:
            self.trace(event)

    def _resolve(self, results: list[RequestResult]) -> None:
        with self._cond:
            for res in results:
                self._streams.close(res.request_id)
                self._futures.pop(res.request_id).set_result(res)

    def close(self, timeout: float | None = None) -> bool:
        """Stop admissions, serve everything queued, stop the thread. True if it drained in time."""
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(timeout)
        with self._cond:  # a prefill thread that timed out still leaves the decoder to finish
            self._cond.notify_all()
        self._decoder.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not (self._thread.is_alive() or self._decoder.is_alive())
