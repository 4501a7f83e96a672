"""The one door to the accelerator: streams, events, pinned memory, graphs and device queries.

In: a `torch.device` (or its name). Out: the real `torch.cuda` objects on a CUDA device, and inert
stand-ins on the CPU, so that code above calls the same functions on every device and no other
module names `torch.cuda` (a test greps). Tests swap the backend for a simulated CUDA device
(`cachesmith.testing.sim_cuda`) that holds CPU data, reports `cuda:0`, raises where CUDA raises
and counts host syncs and copies; the real backend below is what a GPU runs.
"""
from __future__ import annotations

import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Protocol

import torch


class Backend(Protocol):
    """What a CUDA device offers (the real one, or the test suite's simulation)."""

    def is_available(self) -> bool: ...
    def current_index(self) -> int: ...
    def new_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def stream(self, stream: Any) -> AbstractContextManager: ...
    def new_event(self) -> Any: ...
    def new_timing_event(self) -> "TimingEvent": ...
    def synchronize(self, device: torch.device) -> None: ...
    def empty_cache(self) -> None: ...
    def name(self, device: torch.device) -> str: ...
    def version(self) -> str | None: ...
    def memory_allocated(self, device: torch.device) -> int: ...
    def memory_info(self, device: torch.device) -> tuple[int, int]: ...
    def new_graph(self) -> "Graph": ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def sdpa_kernels(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     is_causal: bool, enable_gqa: bool) -> dict[str, Any]: ...


class TimingEvent(Protocol):
    """A point in the device's work whose time can be read once the device has passed it."""

    def record(self) -> None: ...
    def seconds_since(self, start: "TimingEvent") -> float: ...


class Graph(Protocol):
    """A captured sequence of device work (a CUDA graph), replayed without the host launching it."""

    def capture(self, fn: Callable[[], Any]) -> Any: ...
    def replay(self) -> None: ...


class TorchCuda:
    """The real device, through `torch.cuda`."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def stream(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def new_timing_event(self) -> "TimingEvent":
        return _TorchTimingEvent()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def version(self) -> str | None:
        return torch.version.cuda

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def new_graph(self) -> "Graph":
        return _TorchGraph()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def sdpa_kernels(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     is_causal: bool, enable_gqa: bool) -> dict[str, Any]:
        return _torch_sdpa_kernels(q, k, v, mask, is_causal, enable_gqa)


class _TorchTimingEvent:
    """A CUDA event with timing: recorded on the current stream, read after the device passed it."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self._event.record()

    def seconds_since(self, start: "_TorchTimingEvent") -> float:
        self._event.synchronize()
        return start._event.elapsed_time(self._event) / 1e3


class HostTimingEvent:
    """The host clock where work is done when issued (the CPU, the simulated device)."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def seconds_since(self, start: "HostTimingEvent") -> float:
        return self.at - start.at


class _TorchGraph:
    """`torch.cuda.CUDAGraph`, captured after one warm-up run on a side stream (what torch asks:
    lazy initialisations inside the first run must not land in the graph)."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        # thread-local: the prefill and loader threads allocate and sync beside the decode thread
        # while it captures, which the default (global) mode turns into errors in those threads
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


_backend: Backend = TorchCuda()


def use_backend(backend: Backend) -> Backend:
    """Put `backend` in place of the current one and return the one it replaces (tests)."""
    global _backend
    previous, _backend = _backend, backend
    return previous


def backend() -> Backend:
    return _backend


def is_cuda_available() -> bool:
    return _backend.is_available()


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def normalize(device: torch.device | str) -> torch.device:
    """`cuda` as `cuda:N` (the index tensors report), so that a device compares equal to its
    tensors' (`torch.device("cuda") != torch.device("cuda:0")`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", _backend.current_index())
    return device


class _InertStream:
    """A CPU 'stream': work is done when it is issued, so ordering is already given."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _InertEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def new_stream(device: torch.device) -> Any:
    """A side stream on `device` (inert on the CPU)."""
    return _backend.new_stream(device) if is_cuda(device) else _InertStream()


def current_stream(device: torch.device) -> Any:
    return _backend.current_stream(device) if is_cuda(device) else _InertStream()


def on_stream(stream: Any) -> AbstractContextManager:
    """Issue work on `stream` while inside (nothing changes for an inert stream)."""
    return nullcontext() if isinstance(stream, _InertStream) or stream is None else _backend.stream(stream)


def new_event(device: torch.device) -> Any:
    return _backend.new_event() if is_cuda(device) else _InertEvent()


def new_timing_event(device: torch.device) -> TimingEvent:
    """A point in `device`'s work to time from (`later.seconds_since(earlier)`): device time on a
    GPU, where the host runs ahead of the work it launched, without syncing at each point."""
    return _backend.new_timing_event() if is_cuda(device) else HostTimingEvent()


def synchronize(device: torch.device) -> None:
    """Block the host until `device` has done all its work (timing only: never in the serving path)."""
    if is_cuda(device):
        _backend.synchronize(device)


def empty_cache(device: torch.device) -> None:
    if is_cuda(device):
        _backend.empty_cache()


def describe(device: torch.device) -> dict[str, str | None]:
    """The device's name and CUDA version, for payloads (None on the CPU)."""
    if not is_cuda(device):
        return {"cuda": None, "gpu": None}
    return {"cuda": _backend.version(), "gpu": _backend.name(device)}


def memory_allocated(device: torch.device) -> int:
    return _backend.memory_allocated(device) if is_cuda(device) else 0


def memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device's memory: free counts what other processes hold too."""
    if not is_cuda(device):
        raise ValueError(f"memory_info({device}): the CPU's memory is the host's (/proc/meminfo)")
    return _backend.memory_info(device)


def new_graph(device: torch.device) -> Graph | None:
    """A graph to capture work on `device` into; None on the CPU, where nothing is gained."""
    return _backend.new_graph() if is_cuda(device) else None


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Mark `tensor`'s memory as used by `stream` (work other than its allocating stream's): the
    caching allocator then hands it to no new tensor before that stream's work issued so far is
    done. Inert on the CPU."""
    if stream is None or isinstance(stream, _InertStream) or not is_cuda(tensor.device):
        return
    _backend.record_stream(tensor, stream)


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, is_pinned: bool) -> torch.Tensor:
    """A host buffer, page-locked when it feeds asynchronous copies to a device."""
    return torch.empty(shape, dtype=dtype, pin_memory=is_pinned)


# torch's SDPBackend values (`torch.nn.attention.SDPBackend`), as payloads name them
SDPA_KERNEL_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 is_causal: bool = False, enable_gqa: bool = False) -> dict[str, Any] | None:
    """Which of CUDA's fused attention kernels take these `scaled_dot_product_attention` inputs
    (no dropout): `flash`, `efficient`, `cudnn` (bools), the kernel torch `picked` (`math` when none
    took them, or when those that did are turned off) and `reasons`, what torch said of the ones
    that refused. None on the CPU, whose kernels are another set."""
    if not is_cuda(q.device):
        return None
    return _backend.sdpa_kernels(q, k, v, mask, is_causal, enable_gqa)


def _torch_sdpa_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        is_causal: bool, enable_gqa: bool) -> dict[str, Any]:
    """torch's own answers (`sdpa_kernels`): each kernel's check (`can_use_*`; with debug=True each
    refusal's reason comes as a warning, kept here) and the choice `scaled_dot_product_attention`
    makes (`torch._fused_sdp_choice`, which also weighs which kernels are on and their order)."""
    checks = torch.backends.cuda
    params = checks.SDPAParams(q, k, v, mask, 0.0, is_causal, enable_gqa)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        flags = {"flash": checks.can_use_flash_attention(params, debug=True),
                 "efficient": checks.can_use_efficient_attention(params, debug=True),
                 "cudnn": checks.can_use_cudnn_attention(params, debug=True)}
    choice = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, enable_gqa=enable_gqa))
    reasons = list(dict.fromkeys(str(w.message) for w in said))  # once each, in the order said
    return {**flags, "picked": SDPA_KERNEL_NAMES.get(choice, f"backend {choice}"), "reasons": reasons}
