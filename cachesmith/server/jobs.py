"""Work a server does after answering, off every request's path: one worker thread, in order.

In: callables, each under a key (storing a finished chat exchange's KV for the conversation's next
turn, keyed by the conversation's state). Out: nothing but their effects; a failing job is logged
and the server goes on. At most `max_pending` jobs wait or run: past that `submit` drops the job
and says so. `take_over(key)` settles one job for a request that depends on it (the conversation's
next turn) without waiting behind the others: a job still queued runs in the caller's thread
instead, a running one is waited for.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger(__name__)


class BackgroundJobs:
    def __init__(self, name: str, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._pending: set[Future] = set()
        self._by_key: dict[str, tuple[Future, Callable, tuple]] = {}
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, key: str, job: Callable, *args) -> bool:
        """Queue `job(*args)` under `key`; False (and nothing queued) when `max_pending` jobs wait."""
        with self._lock:
            if len(self._pending) >= self.max_pending:
                return False
            future = self._pool.submit(self._run, job, *args)
            self._pending.add(future)
            self._by_key[key] = (future, job, args)
        future.add_done_callback(lambda f: self._forget(key, f))
        return True

    @staticmethod
    def _run(job: Callable, *args) -> None:
        try:
            job(*args)
        except Exception:  # a failed store costs the next turn its reuse, never a request
            log.exception("background job %s failed", getattr(job, "__name__", job))

    def _forget(self, key: str, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
            if key in self._by_key and self._by_key[key][0] is future:
                del self._by_key[key]

    def take_over(self, key: str, timeout_s: float = 30.0) -> None:
        """Settle the job under `key` now: one still queued runs here (behind no other job), a
        running one is waited for (at most `timeout_s`); none: nothing to do."""
        with self._lock:
            entry = self._by_key.get(key)
        if entry is None:
            return
        future, job, args = entry
        if future.cancel():  # not started: it never will be
            self._run(job, *args)
            return
        try:
            future.result(timeout_s)
        except FutureTimeout:  # the request goes on without that job's result
            log.warning("a background job is still running after %.0f s", timeout_s)
        except CancelledError:
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
