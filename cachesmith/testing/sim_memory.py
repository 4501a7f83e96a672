"""Device memory of the simulated CUDA device: a capacity, the bytes live, and their peak.

In: each storage a device tensor of the simulation holds (seen when the tensor is made), and its
freeing (the storage's finalizer). Out: live and peak bytes, `torch.OutOfMemoryError` when an
allocation passes the capacity (as torch's caching allocator raises it), and `mem_get_info`'s
answer from the count. Bytes are counted per storage, so views and wrappers of one allocation
count once; the caching allocator's rounding and its kept free blocks are not modelled.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

GIB = 1 << 30
DEFAULT_CAPACITY_BYTES = 80 * GIB  # an H100's memory, as torch reports it (about 79.1 GiB usable)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.2f} MiB"


class DeviceMemory:
    def __init__(self, capacity_bytes: int, on_free: Callable[[int], None]) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0")
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0  # held outside this process's tensors (`hold`): another process, a test's weights
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # storage data pointer -> bytes
        self._on_free = on_free
        self._lock = threading.Lock()

    def track(self, elem: torch.Tensor) -> bool:
        """Count `elem`'s storage if it is new; True then. Raises `torch.OutOfMemoryError` (and
        counts nothing) when it does not fit."""
        storage = elem.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key == 0 or size == 0:
            return False
        with self._lock:
            if key in self._sizes:
                return False
            free = self.capacity_bytes - self.held_bytes - self.live_bytes
            if size > free:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated). Tried to allocate {_size(size)}. GPU 0 has a total capacity "
                    f"of {_size(self.capacity_bytes)} of which {_size(max(free, 0))} is free. Of the allocated "
                    f"memory {_size(self.live_bytes)} is allocated by tensors")
            self._sizes[key] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)
        return True

    def _free(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._sizes.pop(key, 0)
        self._on_free(key)

    def hold(self, num_bytes: int) -> None:
        """Mark `num_bytes` taken without tensors (what another tenant of the GPU holds, or weights
        a test does not build): they count against the capacity."""
        with self._lock:
            self.held_bytes += num_bytes

    def info(self) -> tuple[int, int]:
        """(free, total), as torch's `mem_get_info` answers."""
        return max(0, self.capacity_bytes - self.held_bytes - self.live_bytes), self.capacity_bytes

    def key(self, elem: torch.Tensor) -> int:
        return elem.untyped_storage().data_ptr()
