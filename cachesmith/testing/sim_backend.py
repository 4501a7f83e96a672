"""Streams, events, graphs and memory queries of the simulated CUDA device: the backend
`cachesmith.model.device` uses while the simulation is on.

In: the simulation (`sim_cuda.SimCuda`). Out: streams and events ordered as CUDA orders them
(`sim_streams`), memory answered from the device's count (`sim_memory`), and graphs that behave as
CUDA graphs do: capture records the device ops with their tensors and runs nothing (what it wrote
is put back, what it allocated holds poison), charges the device sync and cache emptying that
torch's graph context performs (torch/cuda/graphs.py), and refuses host syncs and pageable copies; replay re-runs the
recorded ops on the recorded tensors, with no Python of the caller's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cachesmith.model import device as device_module
from cachesmith.testing.sim_kernels import kernel_flags
from cachesmith.testing.sim_streams import SimEvent, SimStream
from cachesmith.testing.sim_tensor import SimCudaError, SimTensor, _unwrap


CAPTURE_SYNC = "CUDA graph capture (torch's graph context synchronizes the device)"  # the sync's site


class SimGraph:
    """A captured sequence of device ops, replayed on the tensors it was captured on."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self._ops: list | None = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        """`device._TorchGraph.capture` as CUDA runs it: a warm-up on a side stream, then a capture
        that records `fn`'s device ops without running them."""
        sim, order = self.sim, self.sim.order
        home = order.current()
        side = sim.warmup_stream
        side.wait_stream(home)
        with order.on(side):
            fn()
        home.wait_stream(side)
        # torch/cuda/graphs.py, graph.__enter__: synchronize, empty the caching allocator and the pinned host cache
        sim.sync(CAPTURE_SYNC)
        order.device_synchronize()
        sim._add(captures=1, cache_empties=1)
        with sim.recording() as ops:
            out = fn()
        self._ops = ops
        return out

    def replay(self) -> None:
        if self._ops is None:
            raise SimCudaError("replay of a graph that was never captured")
        self.sim.replay(self._ops)
        self.num_replays += 1


class SimBackend:
    """`cachesmith.model.device`'s backend while the simulation is on."""

    def __init__(self, sim) -> None:
        self.sim = sim

    def is_available(self) -> bool:
        return True

    def current_index(self) -> int:
        return 0

    def new_stream(self, device: torch.device) -> SimStream:
        return self.sim.order.new_stream()

    def current_stream(self, device: torch.device) -> SimStream:
        return self.sim.order.current()

    def stream(self, stream: SimStream):
        return self.sim.order.on(stream)

    def new_event(self) -> SimEvent:
        return SimEvent(self.sim.order)

    def new_timing_event(self) -> device_module.HostTimingEvent:
        return device_module.HostTimingEvent()  # ops run when issued: the host clock times them

    def synchronize(self, device: torch.device) -> None:
        self.sim.sync("synchronize")
        self.sim.order.device_synchronize()

    def empty_cache(self) -> None:
        self.sim._add(cache_empties=1)

    def name(self, device: torch.device) -> str:
        return f"simulated CUDA device (CPU data, {self.sim.memory.capacity_bytes / (1 << 30):.0f} GiB)"

    def version(self) -> str | None:
        return None

    def memory_allocated(self, device: torch.device) -> int:
        return self.sim.memory.live_bytes

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return self.sim.memory.info()

    def new_graph(self) -> SimGraph:
        return SimGraph(self.sim)

    def sdpa_kernels(self, q, k, v, mask, is_causal: bool, enable_gqa: bool) -> dict[str, Any]:
        return kernel_flags(*(_unwrap(t) for t in (q, k, v, mask)), is_causal=is_causal, enable_gqa=enable_gqa)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        if not isinstance(tensor, SimTensor):
            raise SimCudaError("record_stream of a host tensor: only device memory belongs to a stream")
        self.sim.num_recorded_streams += 1
        self.sim.order.lend(self.sim.memory.key(tensor.elem), stream)


class Recording:
    """What one capture recorded: the ops, in order, with their tensors, and how to undo the
    capture's effects (CUDA runs nothing while capturing)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []  # (func, args, kwargs, output)
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (its flat view, a copy)
        self._fresh: list[torch.Tensor] = []  # storages allocated inside the capture (the graph's pool)

    def before_write(self, elem: torch.Tensor) -> None:
        """Keep what memory from before the capture held, to put back when it ends."""
        key = elem.untyped_storage().data_ptr()
        if key not in self._saved and all(f.untyped_storage().data_ptr() != key for f in self._fresh):
            flat = _flat(elem)
            self._saved[key] = (flat, flat.clone())

    def allocated(self, elem: torch.Tensor) -> None:
        self._fresh.append(elem)

    def undo(self) -> None:
        """Memory from before the capture as it was; the graph's own memory holds poison."""
        from cachesmith.testing.sim_streams import poison
        for flat, saved in self._saved.values():
            flat.copy_(saved)
        for elem in self._fresh:
            poison(_flat(elem))
        self._saved.clear()


def _flat(elem: torch.Tensor) -> torch.Tensor:
    """The whole storage under `elem`, as one flat tensor of its dtype."""
    storage = elem.untyped_storage()
    return elem.new_empty(0).set_(storage, 0, (storage.nbytes() // elem.element_size(),), (1,))


def transfer(old: Any, new: Any) -> None:
    """A replayed op's results into the tensors its capture produced (a view of the same memory
    needs nothing: it is that memory)."""
    if isinstance(old, SimTensor) and isinstance(new, SimTensor):
        if old is new or (old.elem.untyped_storage().data_ptr() == new.elem.untyped_storage().data_ptr()
                          and old.elem.storage_offset() == new.elem.storage_offset()
                          and old.elem.stride() == new.elem.stride()):
            return
        old.elem.copy_(new.elem)
    elif isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        for o, n in zip(old, new):
            transfer(o, n)
