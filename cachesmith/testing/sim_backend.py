"""Streams, events and graphs of the simulated CUDA device: the backend `cachesmith.model.device`
uses while the simulation is on.

In: the simulation (`sim_cuda.SimCuda`). Out: streams and events that are inert (work is done when
issued) but count their waits as host syncs, and graphs whose capture and replay refuse what CUDA
graph capture refuses.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from cachesmith.model import device as device_module
from cachesmith.testing.sim_tensor import SimCudaError, SimTensor

SIM_MEMORY_BYTES = 16 << 30  # free and total memory the simulated device reports


class SimStream:
    def __init__(self, sim) -> None:
        self.sim = sim

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        self.sim.sync("stream.synchronize")


class SimEvent:
    def __init__(self, sim) -> None:
        self.sim = sim

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        self.sim.sync("event.synchronize")

    def query(self) -> bool:
        return True


class SimGraph:
    """A graph whose capture refuses what capture refuses (syncs, pageable copies) and whose replay
    runs the captured callable again: its inputs and outputs must live in the same tensors."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self._fn: Callable[[], Any] | None = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        fn()  # the warm-up run
        with self.sim.capturing():
            out = fn()
        self._fn = fn
        return out

    def replay(self) -> None:
        with self.sim.capturing():  # a replay launches no host work: nothing may sync
            self._fn()
        self.num_replays += 1


class SimBackend:
    """`cachesmith.model.device`'s backend while the simulation is on."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self._current = SimStream(sim)

    def is_available(self) -> bool:
        return True

    def current_index(self) -> int:
        return 0

    def new_stream(self, device: torch.device) -> SimStream:
        return SimStream(self.sim)

    def current_stream(self, device: torch.device) -> SimStream:
        return self._current

    def stream(self, stream: Any):
        return nullcontext()

    def new_event(self) -> SimEvent:
        return SimEvent(self.sim)

    def new_timing_event(self) -> device_module.HostTimingEvent:
        return device_module.HostTimingEvent()  # work is done when issued: the host clock times it

    def synchronize(self, device: torch.device) -> None:
        self.sim.sync("synchronize")

    def empty_cache(self) -> None:
        return None

    def name(self, device: torch.device) -> str:
        return "simulated CUDA device (CPU data)"

    def version(self) -> str | None:
        return None

    def memory_allocated(self, device: torch.device) -> int:
        return 0

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return SIM_MEMORY_BYTES, SIM_MEMORY_BYTES  # its data is host memory: a device as large as a common one

    def new_graph(self) -> SimGraph:
        return SimGraph(self.sim)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if not isinstance(tensor, SimTensor):
            raise SimCudaError("record_stream of a host tensor: only device memory belongs to a stream")
        self.sim.num_recorded_streams += 1
