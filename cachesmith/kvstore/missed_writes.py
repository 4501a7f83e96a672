"""Writes a store tier missed, and their retry: an entry stored while a tier was away (redis down, a
read-only disk) reaches that tier when it is next read, or when the retrier's next pass finds the
tier back, whichever comes first.

In: the keys each tier failed to take (`MissedWrites.note`), and a store's retry pass. Out: the
tiers an entry still misses (`tiers_of`), and a daemon thread (`WriteRetrier`) that runs the pass
every `interval_s` while any write is missed, and only then. With a journal (a file beside the disk
tier's entries), the list outlives the process: each change is one appended line, each retry pass
rewrites it whole, and a store started on the same disk replays it, so what a killed server stored
during an outage still reaches the shared tier.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from cachesmith.kvstore.keys import is_key
from cachesmith.kvstore.tiers import Tier

log = logging.getLogger(__name__)


class MissedWrites:
    """Keys each tier failed to take when stored, the most recent `MAX_MISSED` (older ones are
    forgotten: their entries then live where they were written, until evicted or read again)."""

    MAX_MISSED = 4096

    def __init__(self, journal: Path | None = None, tiers: Sequence[Tier] = ()) -> None:
        """`journal`: where the list is kept across restarts (replayed now against `tiers`, by name)."""
        self._tiers: OrderedDict[str, list[Tier]] = OrderedDict()
        self._lock = threading.Lock()
        self._journal = journal
        if journal is not None:
            self._replay(journal, {t.name: t for t in tiers})

    def note(self, key: str, tiers: list[Tier], is_retry: bool = False) -> None:
        with self._lock:
            if not tiers:
                if self._tiers.pop(key, None) is not None:
                    self._append(key, [])
                return
            if self._tiers.get(key) != tiers:
                self._append(key, tiers)
            self._tiers[key] = tiers
            if not is_retry:
                self._tiers.move_to_end(key)
            while len(self._tiers) > self.MAX_MISSED:
                self._tiers.popitem(last=False)

    def tiers_of(self, key: str) -> list[Tier]:
        with self._lock:
            return list(self._tiers.get(key, ()))

    def items(self) -> list[tuple[str, list[Tier]]]:
        """A snapshot, oldest first."""
        with self._lock:
            return [(key, list(tiers)) for key, tiers in self._tiers.items()]

    def forget(self, key: str) -> None:
        with self._lock:
            if self._tiers.pop(key, None) is not None:
                self._append(key, [])

    def __len__(self) -> int:
        with self._lock:
            return len(self._tiers)

    def compact(self) -> None:
        """Rewrite the journal from the list as it is (removed when empty)."""
        if self._journal is None:
            return
        with self._lock:
            lines = "".join(_line(key, tiers) for key, tiers in self._tiers.items())
            try:
                if not lines:
                    self._journal.unlink(missing_ok=True)
                    return
                tmp = self._journal.with_name(f".{self._journal.name}.{os.getpid()}.tmp")
                tmp.write_text(lines, encoding="ascii")
                os.replace(tmp, self._journal)
            except OSError as exc:  # a read-only disk: the list in memory still holds it
                log.debug("store: missed-writes journal not rewritten (%s)", exc)

    def _append(self, key: str, tiers: list[Tier]) -> None:
        """Caller holds the lock."""
        if self._journal is None:
            return
        try:
            with self._journal.open("a", encoding="ascii") as f:
                f.write(_line(key, tiers))
        except OSError as exc:
            log.debug("store: missed-writes journal not appended (%s)", exc)

    def _replay(self, journal: Path, by_name: dict[str, Tier]) -> None:
        try:
            lines = journal.read_text(encoding="ascii").splitlines()
        except (OSError, UnicodeDecodeError):
            return  # none yet, or unreadable: nothing is known to be missed
        for line in lines:
            key, _, names = line.partition(" ")
            if not is_key(key):
                continue  # a line cut short by a kill: skipped
            tiers = [by_name[n] for n in names.split(",") if n in by_name]
            if tiers:
                self._tiers[key] = tiers
                self._tiers.move_to_end(key)
            else:
                self._tiers.pop(key, None)
        while len(self._tiers) > self.MAX_MISSED:
            self._tiers.popitem(last=False)


def _line(key: str, tiers: list[Tier]) -> str:
    return f"{key} {','.join(t.name for t in tiers)}\n"


class WriteRetrier:
    """Runs `retry` every `interval_s` on a daemon thread started by `wake` (when a write is
    missed), which ends once `is_pending` says nothing is left: no thread while every tier keeps up.
    A pass that completes nothing doubles the wait, up to `MAX_BACKOFF` x `interval_s` (a tier
    that stays full or away is not read for every pass)."""

    MAX_BACKOFF = 16

    def __init__(self, retry: Callable[[], int], is_pending: Callable[[], bool], interval_s: float) -> None:
        self._retry, self._is_pending, self.interval_s = retry, is_pending, interval_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def is_running(self) -> bool:
        with self._lock:
            return self._thread is not None

    def wake(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="cachesmith-write-back", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        wait_s = self.interval_s
        while not self._stop.wait(wait_s):
            try:
                num_done = self._retry()
            except Exception:  # a pass must never end the retries: the next one tries again
                log.exception("store: retrying missed writes failed")
                num_done = 0
            wait_s = self.interval_s if num_done else min(2 * wait_s, self.MAX_BACKOFF * self.interval_s)
            with self._lock:  # decided under the lock `wake` takes, so no missed write is left alone
                if not self._is_pending():
                    self._thread = None
                    return

    def close(self) -> None:
        self._stop.set()
