"""The disk tier's byte quota: which entries it holds, how large, in what access order, which are in use.

In: the disk tier's events (an entry opened, closed, about to be written, written, deleted) and the
entry files found under its root at start. Out: least-recently-used entries unlinked so that the
entry files this process knows of stay within `max_bytes`, and `TierUsage` for `cachesmith store stats`.

An entry is *in use* (pinned) from `pin` until its source is closed; eviction and pruning skip it, so
a loader thread never loses an entry it is reading. Room is made *before* a write (`reserve`), so
the files on disk never exceed the quota, not even for the moment between a write and its eviction.

Several processes on one root: each keeps its own bookkeeping, of the entries found at its start,
those it wrote and those it read. There is no LRU across processes: one process may evict an entry
another has just read (or has open: on POSIX an open reader keeps reading the unlinked file), and N
processes with quota Q each may hold up to about N x Q together. Files another process deleted are
forgotten when found missing (a read miss, an eviction's FileNotFoundError), never an error.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachesmith.errors import InputError
from cachesmith.kvstore.keys import validate_key

log = logging.getLogger(__name__)
DEFAULT_DISK_FRACTION = 0.5  # of (free space + bytes already stored) on the root's filesystem, at start
TOUCH_INTERVAL_S = 60.0  # a file's atime is moved at most this often: access order survives restarts


@dataclass(frozen=True)
class TierUsage:
    """One tier's contents as `cachesmith store stats` prints them."""

    tier: str
    num_entries: int
    num_bytes: int
    max_bytes: int | None  # None: no byte bound this tier enforces (redis: see `note`)
    oldest_access: float | None = None  # unix time of the least recently used entry (disk)
    note: str = ""


def scan_entries(root: Path) -> list[tuple[str, int, float]]:
    """(key, bytes, last access) of every entry file under `root`, least recently used first. Last
    access is the later of atime and mtime: a `noatime` mount leaves atime behind the write."""
    found = []
    for path in root.glob("*/*.cskv"):
        try:
            validate_key(path.stem)  # a stray file is no entry: never counted, never evicted
            st = path.stat()
        except (InputError, FileNotFoundError):  # or deleted by another process while scanning
            continue
        found.append((path.stem, st.st_size, max(st.st_atime, st.st_mtime)))
    return sorted(found, key=lambda entry: (entry[2], entry[0]))


def default_max_bytes(root: Path, num_stored_bytes: int, fraction: float = DEFAULT_DISK_FRACTION) -> int:
    """`fraction` of the space the store could have on `root`'s filesystem: what is free plus what the
    store already holds, so the default does not shrink (and evict) as the store fills up."""
    st = os.statvfs(root)
    return int(fraction * (st.f_bavail * st.f_frsize + num_stored_bytes))


class DiskQuota:
    """LRU byte bookkeeping of one disk tier; every method is thread-safe.

    `path_of(key)` names an entry's file; eviction unlinks it. A reentrant lock, because a
    FileSource closed by the garbage collector calls `unpin` on whichever thread runs it."""

    def __init__(self, path_of: Callable[[str], Path], max_bytes: int,
                 entries: list[tuple[str, int, float]] = ()) -> None:
        self.path_of = path_of
        self.max_bytes = max_bytes
        # key -> (bytes, last access, last time the file's atime or mtime was moved)
        self._entries: OrderedDict[str, tuple[int, float, float]] = OrderedDict()
        for key, size, accessed in entries:
            self._entries[key] = (size, accessed, accessed)
        self.num_bytes = sum(entry[0] for entry in self._entries.values())
        self.num_reserved = 0  # bytes of writes under way: room is made for them before they land
        self.num_evicted = 0
        self._pins: Counter[str] = Counter()
        self._lock = threading.RLock()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def pin(self, key: str) -> None:
        with self._lock:
            self._pins[key] += 1

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._pins[key] > 0

    def touch(self, key: str, size: int) -> bool:
        """Mark `key` most recently used (adopting an entry another process wrote); whether its
        file's atime is due to be moved too."""
        now = time.time()
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                self.num_bytes += size
                old = (size, now, 0.0)
            is_due = now - old[2] >= TOUCH_INTERVAL_S
            self._entries[key] = (old[0], now, now if is_due else old[2])
            return is_due

    def reserve(self, key: str, size: int) -> int | None:
        """Make room for a `size`-byte write of `key`, evicting least recently used entries not in use.
        Returns the bytes reserved (for `commit`/`cancel`), or None (logged, nothing evicted) when the
        entry is larger than the quota or entries in use hold too much of it."""
        with self._lock:
            if size > self.max_bytes:
                log.warning("disk tier: entry %s of %d bytes is larger than the whole quota "
                            "(disk_max_bytes=%d); not stored on disk", key[:12], size, self.max_bytes)
                return None
            growth = size  # the new file lies beside the old one until the rename: room for all of it
            if not self._make_room(growth, keep=key):
                log.warning("disk tier: no room for entry %s of %d bytes within disk_max_bytes=%d: "
                            "entries in use hold the rest; not stored on disk", key[:12], size, self.max_bytes)
                return None
            self.num_reserved += growth
            # in use until `commit` or `cancel`: an eviction between the writer's rename and its
            # commit would unlink the file just written while the books still count it
            self._pins[key] += 1
            return growth

    def holds(self, key: str, size: int) -> bool:
        """Whether `key` is stored at `size` bytes (content-addressed: then its bytes are the same)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry[0] == size

    def commit(self, key: str, size: int, num_reserved: int) -> None:
        """The write of `key` that reserved `num_reserved` bytes landed: count it as the most recently
        used entry."""
        with self._lock:
            self.num_reserved -= num_reserved
            self.unpin(key)
            old = self._entries.pop(key, None)
            self.num_bytes += size - (old[0] if old is not None else 0)
            now = time.time()
            self._entries[key] = (size, now, now)  # the write moved its mtime
            # a concurrent eviction of this key's old file between reserve and commit: evict again
            self._make_room(0, keep=key)

    def cancel(self, key: str, num_reserved: int) -> None:
        """The write of `key` that reserved `num_reserved` bytes failed."""
        with self._lock:
            self.num_reserved -= num_reserved
            self.unpin(key)

    def forget(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[0]

    def forget_if_missing(self, key: str) -> None:
        """Forget `key` if its file is gone (deleted by another process). Checked under the lock, so
        a write of `key` landing now (committed under the lock after its rename) is not forgotten."""
        with self._lock:
            if not self.path_of(key).exists():
                self.forget(key)

    def _make_room(self, incoming: int, keep: str) -> bool:
        """Evict LRU entries (not `keep`, none in use) until `incoming` more bytes fit. Caller holds
        the lock; files are unlinked under it, so no reader can pin an entry mid-eviction."""
        excess = self.num_bytes + self.num_reserved + incoming - self.max_bytes
        victims, num_freeable = [], 0
        for key, (size, *_) in self._entries.items():
            if num_freeable >= excess:
                break
            if key != keep and self._pins[key] <= 0:
                victims.append((key, size))
                num_freeable += size
        if num_freeable < excess:  # entries in use hold the rest: evict nothing
            return False
        return sum(size for key, size in victims if self._unlink(key)) >= excess

    def _unlink(self, key: str) -> bool:
        try:
            self.path_of(key).unlink()
        except FileNotFoundError:  # deleted by another process or `store prune`: already gone
            pass
        except OSError as exc:  # kept and counted: the file is still there
            log.warning("disk tier: cannot evict %s (%s)", key[:12], exc)
            return False
        self.forget(key)
        self.num_evicted += 1
        return True

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None,
              progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        """Evict least recently used entries not in use until at most `max_bytes` remain, and every
        entry last used more than `older_than_s` ago. `progress(num_entries, num_bytes)` after each.
        Returns (entries, bytes) evicted. The lock is taken per entry, so serving goes on meanwhile."""
        cutoff = None if older_than_s is None else time.time() - older_than_s
        skipped: set[str] = set()  # entries whose file cannot be unlinked: tried once
        num_pruned = num_freed = 0
        while (victim := self._next_prunable(max_bytes, cutoff, skipped)) is not None:
            key, size = victim
            with self._lock:
                is_evicted = self._pins[key] <= 0 and key in self._entries and self._unlink(key)
            if not is_evicted:
                skipped.add(key)
                continue
            num_pruned, num_freed = num_pruned + 1, num_freed + size
            if progress is not None:
                progress(num_pruned, num_freed)
        return num_pruned, num_freed

    def _next_prunable(self, max_bytes: int | None, cutoff: float | None,
                       skipped: set[str]) -> tuple[str, int] | None:
        with self._lock:
            is_over = max_bytes is not None and self.num_bytes > max_bytes
            for key, (size, accessed, _) in self._entries.items():
                if not (is_over or (cutoff is not None and accessed < cutoff)):
                    return None  # LRU order: every later entry is newer and the total already fits
                if self._pins[key] <= 0 and key not in skipped:
                    return key, size
        return None

    def usage(self) -> TierUsage:
        with self._lock:
            oldest = next(iter(self._entries.values()))[1] if self._entries else None
            return TierUsage("disk", len(self._entries), self.num_bytes, self.max_bytes, oldest)
