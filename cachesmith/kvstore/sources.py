"""Byte sources of stored entries: `RangeSource`s over memory bytes and open disk files.

In: an entry's bytes or its file's path. Out: `readinto`/`readinto_many` of any byte range (one
scatter `preadv` for a file), so a reader fetches one layer or a few rows without the rest.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


class _SequentialReads:
    """readinto_many for sources without scatter reads: consecutive readinto calls."""

    def readinto_many(self, offset: int, buffers: list[memoryview]) -> int:
        total = 0
        for buf in buffers:
            n = self.readinto(offset + total, buf)
            total += n
            if n < len(buf):
                break
        return total


class BytesSource(_SequentialReads):
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.size = len(data)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        n = max(0, min(len(buffer), self.size - offset))
        buffer[:n] = self.data[offset:offset + n]
        return n

    def close(self) -> None:
        return None


class FileSource(_SequentialReads):
    """An open entry file; `on_close` runs once when it is closed (the disk tier unpins the entry)."""

    def __init__(self, path: Path, on_close=None) -> None:
        self.fd, self._on_close = -1, None  # so close() is safe when the open below fails
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self._on_close = on_close

    def readinto(self, offset: int, buffer: memoryview) -> int:
        total = 0
        while total < len(buffer):
            n = os.preadv(self.fd, [buffer[total:]], offset + total)
            if n == 0:
                break
            total += n
        return total

    def readinto_many(self, offset: int, buffers: list[memoryview]) -> int:
        """One scatter read (preadv) for consecutive ranges, e.g. a layer's K and V."""
        total = os.preadv(self.fd, buffers, offset)
        if total < sum(len(b) for b in buffers):  # a short read: finish buffer by buffer
            return total + super().readinto_many(offset + total, _rest(buffers, total))
        return total

    def touch_atime(self) -> None:
        """Move the file's atime (mtime stays the write time), so a later scan knows the access order.
        Another user's file or a read-only mount refuses: the order is then the write order."""
        try:
            os.utime(self.fd, ns=(time.time_ns(), self.mtime_ns))
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        self.close()


def _rest(buffers: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for buf in buffers:
        if skip >= len(buf):
            skip -= len(buf)
            continue
        out.append(buf[skip:])
        skip = 0
    return out
