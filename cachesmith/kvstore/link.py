"""A token-bucket link that emulates a capped transfer bandwidth (e.g. the paper's 10/6/3 GB/s).

`consume(n)` reserves n bytes and sleeps until the link has carried them; concurrent callers queue
behind each other's reservations. `set_bandwidth` changes the rate mid-batch (fault injection).
"""
from __future__ import annotations

import threading
import time

from cachesmith.errors import ConfigError


class Link:
    def __init__(self, gbps: float | None, burst_s: float = 0.001) -> None:
        self._lock = threading.Lock()
        self._burst_s = burst_s
        self._free_at = time.monotonic()  # when the link has carried every reservation so far
        self.set_bandwidth(gbps)

    @property
    def gbps(self) -> float | None:
        return None if self._rate is None else self._rate / 1e9

    def set_bandwidth(self, gbps: float | None) -> None:
        if gbps is not None and not gbps > 0:
            raise ConfigError(f"bandwidth {gbps} GB/s must be positive (or None for uncapped)")
        with self._lock:
            self._rate = None if gbps is None else gbps * 1e9

    def consume(self, nbytes: int) -> float:
        """Block until `nbytes` have passed the link. Returns the `time.monotonic()` at which they
        started to pass (after the reservations queued before them), for bandwidth estimates."""
        with self._lock:
            now = time.monotonic()
            if self._rate is None:
                return now
            start = max(self._free_at, now - self._burst_s)
            self._free_at = start + nbytes / self._rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)
        return max(start, now)
