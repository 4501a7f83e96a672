"""The disk tier: one file per chunk KV entry under a root folder, within a byte quota.

In: entry bytes by key (`put`), keys to open (`source`) or delete. Out: `FileSource`s pinned while
open, and the quota's usage. Writes go to a temporary file renamed into place, after room is made
for them (`disk_quota.DiskQuota`); temporary files of writers that died are swept at start.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from pathlib import Path

from cachesmith.errors import InputError
from cachesmith.kvstore.disk_quota import DiskQuota, TierUsage, default_max_bytes, scan_entries
from cachesmith.kvstore.keys import validate_key
from cachesmith.kvstore.sources import FileSource
from cachesmith.kvstore.tiers import Tier

log = logging.getLogger(__name__)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class DiskTier(Tier):
    """One file per entry under `root`, within `max_bytes` (None or 0: `DEFAULT_DISK_FRACTION` of the
    free space plus what the store holds, at start). Least recently used entries not in use are
    evicted before a write that would not fit; several processes on one root: see `disk_quota`."""

    name = "disk"

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise InputError(f"disk tier max_bytes={max_bytes} must be positive (or 0/None for the default)")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_swept = self._sweep_temp_files()
        # temporary files a failed write could not remove (a folder gone read-only), each with the
        # key and bytes it reserved: still on disk, so still counted, until a later put removes them
        self._stranded: list[tuple[Path, str, int]] = []
        self._stranded_lock = threading.Lock()
        self.is_default_quota = not max_bytes
        self.quota = self._scan(max_bytes)

    def _scan(self, max_bytes: int | None) -> DiskQuota:
        found = scan_entries(self.root)
        num_stored = sum(size for _, size, _ in found)
        quota = DiskQuota(self.path, max_bytes or default_max_bytes(self.root, num_stored), found)
        if num_stored > quota.max_bytes:  # a lowered quota: the next write evicts down to it
            log.warning("disk tier %s holds %d bytes in %d entries, above disk_max_bytes=%d; writes evict "
                        "the least recently used", self.root, num_stored, len(found), quota.max_bytes)
        return quota

    def _sweep_temp_files(self) -> int:
        """Remove temporary files of writers that died mid-write (`kill -9` during a put): their
        process is gone, so no rename will ever come. A live writer's file is left alone."""
        swept = 0
        for tmp in self.root.glob("*/.*.tmp"):
            pid = tmp.name.rsplit(".", 3)[-3] if tmp.name.count(".") >= 4 else ""
            if pid.isdigit() and _is_alive(int(pid)):
                continue
            try:
                tmp.unlink()
                swept += 1
            except OSError:
                pass
        if swept:
            log.warning("disk tier: removed %d temporary file(s) left by writers that died mid-write", swept)
        return swept

    def path(self, key: str) -> Path:
        # a valid key is 64 lower-case hex digits, so the path stays under the (resolved) root
        # without resolving it again on every open
        validate_key(key)
        return self.root / key[:2] / f"{key}.cskv"

    def source(self, key: str):
        """The entry's open file, pinned (never evicted) until closed; None if absent."""
        path = self.path(key)
        self.quota.pin(key)  # before the open: an eviction between the two would remove a file in use
        try:
            source = FileSource(path, on_close=lambda: self.quota.unpin(key))
        except FileNotFoundError:
            self.quota.unpin(key)
            self.quota.forget_if_missing(key)  # deleted by another process or `store prune`
            return None
        except BaseException:
            self.quota.unpin(key)
            raise
        if self.quota.touch(key, source.size):
            source.touch_atime()
        return source

    def put(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        if self.quota.holds(key, len(data)) and path.exists():  # the same bytes, by their key: nothing to write
            return True
        self._remove_stranded()
        num_reserved = self.quota.reserve(key, len(data))  # evicts first, so the files never exceed it
        if num_reserved is None:
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
                self.quota.cancel(key, num_reserved)
            except OSError:  # a folder gone read-only keeps it, and its bytes stay reserved
                with self._stranded_lock:
                    self._stranded.append((tmp, key, num_reserved))
            level = "disk full" if exc.errno == errno.ENOSPC else "write failed"
            log.warning("disk tier: %s for %s (%s); serving continues without it", level, key[:12], exc)
            return False
        self.quota.commit(key, len(data), num_reserved)
        return True

    def _remove_stranded(self) -> None:
        """Remove the temporary files earlier writes left behind, and give back their reservations."""
        with self._stranded_lock:
            stranded, self._stranded = self._stranded, []
        for entry in stranded:
            tmp, key, num_reserved = entry
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # still read-only: tried again at the next put
                with self._stranded_lock:
                    self._stranded.append(entry)
                continue
            self.quota.cancel(key, num_reserved)

    def delete(self, key: str) -> bool:
        """Remove the entry even while in use (a corrupt or deleted chunk): open readers keep their file."""
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:  # a read-only or failing disk: the entry stays, and says so
            log.warning("disk tier: cannot delete %s (%s)", key[:12], exc)
            return False
        self.quota.forget(key)
        return True

    def usage(self) -> TierUsage:
        return self.quota.usage()

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None, progress=None):
        """Evict LRU entries not in use down to `max_bytes` and those unused for `older_than_s`, of
        any model (entries are content-addressed). Returns (entries, bytes) evicted."""
        return self.quota.prune(max_bytes, older_than_s, progress)

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*/*.cskv"))

    @property
    def is_up(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.R_OK | os.W_OK)
