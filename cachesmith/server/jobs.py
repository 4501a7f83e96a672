"""Work a server does after answering, off every request's path: one worker thread, in order.

In: callables (storing a finished chat exchange's KV for the conversation's next turn). Out: nothing
but their effects; a failing job is logged and the server goes on. `wait_all` lets a request that
depends on earlier jobs (the conversation's next turn) wait for them.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class BackgroundJobs:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._pending: set[Future] = set()
        self._lock = threading.Lock()

    def submit(self, job: Callable, *args) -> None:
        future = self._pool.submit(self._run, job, *args)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    @staticmethod
    def _run(job: Callable, *args) -> None:
        try:
            job(*args)
        except Exception:  # a failed store costs the next turn its reuse, never a request
            log.exception("background job %s failed", getattr(job, "__name__", job))

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def wait_all(self, timeout_s: float = 30.0) -> None:
        """Wait for the jobs submitted so far (at most `timeout_s` each)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.result(timeout_s)
            except Exception:  # timed out: the request goes on without that job's result
                log.warning("a background job is still running after %.0f s", timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
