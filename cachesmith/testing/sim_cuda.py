"""A simulated CUDA device: CUDA's semantics checked on a machine without a GPU.

In: code that runs on `device="cuda"`. Out: the same results as on the CPU (every tensor holds CPU
data), an error wherever a real GPU would raise, and counts of what a GPU would pay for.

- A `SimTensor` holds a CPU tensor and reports `cuda:0`. A `TorchFunctionMode` (entered on every
  thread started while the simulation is on: a mode is thread-local) runs each torch call that
  touches one on the CPU data and wraps the results; factories given `device="cuda"`, `.to("cuda")`
  and `.cuda()` make them. Function level, not dispatcher level: Python indexing of a dispatcher
  subclass reaches a CUDA device guard that a CPU build of torch cannot pass.
- It raises (`SimCudaError`) where CUDA raises: `.numpy()` of a device tensor, an op mixing a CPU
  tensor (not a 0-dim scalar) with a device tensor, a device pointer handed to host code
  (`data_ptr`, what the native C kernels take), and a host sync or a copy from pageable host
  memory while a graph is being captured (on the capturing thread).
- It counts, per `count()` region and across threads: ops on device tensors, host syncs (`item`,
  `tolist`, `nonzero`, `bool`/`int`/`float`, `equal`, a boolean mask index, an event or device
  synchronize), copies each way, and findings: a `non_blocking` host -> device copy from memory
  that is not pinned, and an attention call that only torch's math kernel runs on CUDA.
- Streams, events and graphs come through `cachesmith.model.device`, whose backend it replaces.
  Streams are ordered as CUDA orders them (`sim_streams`): an op reading or overwriting memory
  that another stream used with no wait between is a finding, and so is a tensor freed while
  another stream may still use it; a non-blocking copy between pinned memory and the device lands
  only at a sync or a wait that covers it (its destination holds poison until then). A graph's
  capture runs nothing and its replay re-runs the recorded ops (`sim_backend`). Device memory has
  a capacity (`sim_memory`): an allocation past it raises `torch.OutOfMemoryError`.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from cachesmith.model import device as device_module
from cachesmith.testing import sim_tensor
from cachesmith.testing.sim_backend import Recording, SimBackend, transfer
from cachesmith.testing.sim_calls import (
    _HOST_SPECIAL, _INDEXED, _METADATA, _OWN_PROPERTIES, _RAISES, _SYNCS, Counts, spans, written)
from cachesmith.testing.sim_copies import SPECIAL, sdpa_kernel
from cachesmith.testing.sim_clock import SimClock
from cachesmith.testing.sim_memory import DEFAULT_CAPACITY_BYTES, DeviceMemory
from cachesmith.testing.sim_streams import StreamOrder
from cachesmith.testing.sim_tensor import CPU, SimCudaError, SimTensor, _is_cuda, _name, _unwrap

class SimCuda:
    """The simulation, on while entered (`with SimCuda() as sim:`); `sim.count()` measures a region."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, clock: SimClock | None = None) -> None:
        """`clock`: the timed mode (`sim_clock`), advanced by every call, sync and replay."""
        self.clock = clock
        self._lock = threading.Lock()
        self.order = StreamOrder(lambda msg: self._add(finding=f"stream: {msg}"), self.sync)
        self.memory = DeviceMemory(capacity_bytes, self.order.freed)
        self.warmup_stream = self.order.new_stream("graph warm-up")
        self._regions: list[Counts] = []
        self._pinned: dict[int, weakref.ref] = {}  # id of a pinned base tensor -> it
        self._capture = threading.local()  # per thread: CUDA captures in thread-local mode (`device`)
        self.num_recorded_streams = 0  # record_stream calls: device memory lent to a side stream
        self.total = Counts()

    # -- on and off ------------------------------------------------------------------------
    def __enter__(self) -> "SimCuda":
        if sim_tensor._active[0] is not None:
            raise SimCudaError("a simulated CUDA device is already on")
        sim_tensor._active[0] = self
        self._previous_backend = device_module.use_backend(SimBackend(self))
        self._boot = threading.Thread._bootstrap_inner
        sim = self

        def bootstrap(thread):  # every new thread runs under the mode, as the loaders must
            with _Mode(sim):
                sim._boot(thread)

        threading.Thread._bootstrap_inner = bootstrap
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        threading.Thread._bootstrap_inner = self._boot
        device_module.use_backend(self._previous_backend)
        sim_tensor._active[0] = None

    @contextmanager
    def count(self) -> Iterator[Counts]:
        """Counts of the work done inside, on any thread."""
        counts = Counts()
        with self._lock:
            self._regions.append(counts)
        try:
            yield counts
        finally:
            with self._lock:  # by identity: nested regions may hold equal counts
                self._regions = [r for r in self._regions if r is not counts]

    @property
    def is_capturing(self) -> bool:
        """Whether this thread is capturing a graph (others, e.g. the prefill thread, go on as usual)."""
        return getattr(self._capture, "is_on", False)

    @property
    def is_in_graph(self) -> bool:
        """Whether this thread's device ops go into a graph (captured or replayed), not a stream."""
        return self.is_capturing

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Inside, on this thread, a sync or a pageable copy raises, as during CUDA graph capture."""
        self._capture.is_on = True
        try:
            yield
        finally:
            self._capture.is_on = False

    @contextmanager
    def recording(self) -> Iterator[list]:
        """A capture on this thread: its device ops recorded (yielded), their effects undone at the end."""
        rec = self._capture.rec = Recording()
        try:
            with self.capturing():
                yield rec.ops
        finally:
            self._capture.rec = None
            rec.undo()

    def replay(self, ops: list) -> None:
        """A graph's recorded ops again, on their tensors: no allocation, no host work."""
        if self.clock is not None:
            self.clock.replay()
        self._capture.is_replaying = True
        try:
            with self.capturing():
                for func, args, kwargs, out in ops:
                    transfer(out, self.handle(func, args, kwargs))
        finally:
            self._capture.is_replaying = False
        self._add(replays=1)

    def allocated(self, elem: torch.Tensor) -> None:
        """A device tensor was made over `elem`: its storage counts if it is new (not in a replay,
        whose graph's memory was allocated when it was captured)."""
        if getattr(self._capture, "is_replaying", False):
            return
        if self.memory.track(elem):
            news = getattr(self._capture, "new_keys", None)
            if news is not None:
                news.add(self.memory.key(elem))
            rec = getattr(self._capture, "rec", None)
            if rec is not None:
                rec.allocated(elem)

    # -- what is counted -------------------------------------------------------------------
    def _add(self, **kwargs) -> None:
        with self._lock:
            for counts in (self.total, *self._regions):
                for key, value in kwargs.items():
                    if key == "finding":
                        counts.findings.append(value)
                    elif key == "kernel":
                        counts.attention[value] += 1
                    elif key == "site":
                        counts.sync_sites.append(value)
                    else:
                        setattr(counts, key, getattr(counts, key) + value)

    def sync(self, what: str) -> None:
        if self.is_capturing:
            raise SimCudaError(f"{what}: a host sync while a CUDA graph is being captured")
        self._add(syncs=1, site=what)
        if self.clock is not None:
            self.clock.sync()

    def h2d(self, src: torch.Tensor | None, is_non_blocking: bool, what: str) -> None:
        is_pinned = src is not None and self.is_pinned(src)
        if self.is_capturing and not is_pinned:
            raise SimCudaError(f"{what}: a copy from pageable host memory while a CUDA graph is being captured")
        self._add(h2d=1)
        if is_non_blocking and not is_pinned:
            self._add(finding=f"{what}: non_blocking host -> device copy from memory that is not pinned")

    def d2h(self, what: str) -> None:
        if self.is_capturing:
            raise SimCudaError(f"{what}: a device -> host copy while a CUDA graph is being captured")
        self._add(d2h=1)

    # -- pinned host memory ----------------------------------------------------------------
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        self._pinned[key] = weakref.ref(t, lambda _, key=key: self._pinned.pop(key, None))
        return t

    def _is_marked(self, t: torch.Tensor) -> bool:
        ref = self._pinned.get(id(t))
        return ref is not None and ref() is t

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether `t` is a pinned buffer or a view of one. Views are marked as they are made
        (`handle`): under inference mode a view keeps no `_base`."""
        return self._is_marked(t) or (t._base is not None and self._is_marked(t._base))

    def _mark_view(self, src, out) -> None:
        """A view of a pinned buffer is pinned memory too."""
        if (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and self._is_marked(src)
                and out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()):
            self.pin(out)

    # -- the torch calls -------------------------------------------------------------------
    def handle(self, func, args: tuple, kwargs: dict) -> Any:
        name = _name(func)
        if name.startswith("get:"):
            return self._property(func, name[4:], args)
        flat = tree_flatten((args, kwargs))[0]
        sims = [t for t in flat if isinstance(t, SimTensor)]
        if name in _RAISES and sims:
            raise SimCudaError(f"{name}: {_RAISES[name]}")
        special = SPECIAL.get(name)
        if special is not None and (sims or name in _HOST_SPECIAL):
            out = special(self, func, args, kwargs, sims)
            if out is not NotImplemented:
                self._record(func, args, kwargs, out)
                self._timed(name, args, kwargs, out, is_link=True)
                return out
        wants_device = _is_cuda(kwargs.get("device"))
        if sims and kwargs.get("device") is not None and not wants_device:  # e.g. empty_like(x, device="cpu")
            return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        wants_pinned = kwargs.get("pin_memory") is True
        if not sims and not wants_device and not wants_pinned:
            return self._host_op(func, name, args, kwargs)
        if sims and name not in _INDEXED:
            self._check_mixed(name, flat)
        if name in _SYNCS and sims:
            self.sync(name)
        is_device_op = name not in _METADATA and (sims or wants_device)
        if is_device_op and not self.is_replaying:
            self._add(ops=1)
        if name in _INDEXED and sims:
            self._index_copies(name, args)
        if name == "scaled_dot_product_attention":
            self._add(kernel=sdpa_kernel(args, kwargs))
        called = kwargs  # what a graph replays: the call as the caller made it
        if wants_device:
            kwargs = {**kwargs, "device": CPU}
        if wants_pinned:
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        with self._ordered(name, sims, args, kwargs, is_device_op) as done:
            out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
            if wants_pinned:
                return self.pin(out)
            if name in _SYNCS and not isinstance(out, torch.Tensor):
                return out
            out = done(self._wrap(out, sims, args))
        self._record(func, args, called, out)
        if is_device_op:
            self._timed(name, args, kwargs, out)
        return out

    def _timed(self, name: str, args: tuple, kwargs: dict, out, is_link: bool = False) -> None:
        """The call on the timed mode's clocks (`sim_clock`), where it is on. A special call (a
        copy, a factory of host data) crosses the link only where host and device tensors meet."""
        if self.clock is None:
            return
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        is_link = is_link and any(isinstance(t, SimTensor) for t in tensors) and \
            any(not isinstance(t, SimTensor) for t in tensors)
        self.clock.call(name, tree_map(_unwrap, args), tree_map(_unwrap, kwargs), tree_map(_unwrap, out),
                        self.order.current().id, self.is_replaying, self.is_in_graph, is_link)
        if is_link and any(not isinstance(t, SimTensor) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            self.clock.sync()  # a copy back: the host has the values only once it landed

    def _host_op(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        """A torch call on host tensors only: the host's own work (on pinned memory, it must not
        race a pending asynchronous copy)."""
        if self.order.pending and args and isinstance(args[0], torch.Tensor) and self.is_pinned(args[0]):
            self.order.host_touches(args[0], f"{name} on the host")
        out = func(*args, **kwargs)
        if self._pinned and args:
            self._mark_view(args[0], out)
        return out

    @contextmanager
    def _ordered(self, name: str, sims: list, args: tuple, kwargs: dict, is_device_op: bool):
        """Around a device op: copies it depends on land first; after it, the streams hear what it
        read, wrote and allocated (a view launches nothing: not heard)."""
        if not is_device_op or self.is_in_graph and not self.is_replaying:
            self._before_write_in_capture(name, args, kwargs)
            yield lambda out: out
            return
        targets = written(name, args, kwargs)
        reads, writes = spans([t for t in sims if not any(t is w for w in targets)]), spans(targets)
        keys = set(reads) | set(writes)
        self.order.land(keys)
        self._capture.new_keys = new_keys = set()
        result = []
        yield lambda out: result.append(out) or out
        self._capture.new_keys = None
        outs = [t for t in tree_flatten(result)[0] if isinstance(t, SimTensor)]
        if not targets and outs and all(self.memory.key(t.elem) in keys for t in outs):
            return  # a view
        self.order.op(name, reads, writes, new_keys)
        if name in _SYNCS:  # the host waited for the stream, this read included
            self.order.host_waited_for(self.order.current())

    def _before_write_in_capture(self, name: str, args: tuple, kwargs: dict) -> None:
        for t in written(name, args, kwargs):
            self.before_graph_write(t.elem)

    def before_graph_write(self, elem: torch.Tensor) -> None:
        """A capture is about to write `elem`: what it holds now is put back when the capture ends."""
        rec = getattr(self._capture, "rec", None)
        if rec is not None:
            rec.before_write(elem)

    @property
    def is_replaying(self) -> bool:
        return getattr(self._capture, "is_replaying", False)

    def _record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Inside a capture, a device op goes into the graph with its tensors."""
        rec = getattr(self._capture, "rec", None)
        if rec is not None and any(isinstance(t, SimTensor) for t in tree_flatten((args, kwargs, out))[0]):
            rec.ops.append((func, args, kwargs, out))

    def _property(self, func, prop: str, args: tuple) -> Any:
        target = args[0]
        if prop in _OWN_PROPERTIES or not isinstance(target, SimTensor):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args)
        if not self.is_replaying:
            self._add(ops=1)
        out = self._wrap(func(target.elem, *args[1:]), [target], args)
        self._record(func, args, {}, out)
        return out

    @staticmethod
    def _wrap(out, sims: list, args: tuple):
        """CPU results as device tensors; an in-place op gives back the wrapper it was called on."""
        by_elem = {id(s.elem): s for s in sims}

        def wrap(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, SimTensor):
                same = by_elem.get(id(x))
                return SimTensor(x) if same is None else same
            return x
        return tree_map(wrap, out)

    @staticmethod
    def _check_mixed(name: str, flat: list) -> None:
        for t in flat:
            if isinstance(t, torch.Tensor) and not isinstance(t, SimTensor) and t.dim() > 0:
                raise SimCudaError(f"{name}: expected all tensors on one device, found cuda:0 and cpu "
                                   f"(a cpu tensor of shape {tuple(t.shape)})")

    def _index_copies(self, name: str, args: tuple) -> None:
        index = args[1] if len(args) > 1 else None
        for t in tree_flatten(index)[0]:
            if isinstance(t, torch.Tensor):
                if t.dtype == torch.bool:  # a boolean mask: its true count sizes the result
                    self.sync(f"{name} with a boolean mask")
                if not isinstance(t, SimTensor) and t.dim() > 0:
                    self.h2d(t, False, f"{name} with a host index")
        if name == "__setitem__" and len(args) > 2:
            value = args[2]
            if isinstance(value, torch.Tensor) and not isinstance(value, SimTensor) and value.dim() > 0:
                self.h2d(value, False, "__setitem__ of host values")


class _Mode(TorchFunctionMode):
    def __init__(self, sim: SimCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.sim.handle(func, args, kwargs or {})


def active() -> SimCuda | None:
    """The simulation that is on, if any."""
    return sim_tensor._active[0]
