"""The simulated CUDA device's timed mode: a host clock and a clock per stream, advanced by a cost
model of a named GPU, so a run on the simulation forecasts what it would take on that GPU.

In: each torch call the simulation handles (name, arguments, result, stream), host syncs and graph
replays, recorded as they come. Out: any stretch of them timed on a `DeviceSpec` (`Timing`: the
elapsed seconds, the host's, the kernels' by what binds them, calls and kernels counted).

- A torch call from the host costs `host_call_s` of host time (dispatch and launch); its kernel
  starts no earlier than the host got there, and after its stream's previous kernel.
- A kernel takes its roofline time: its FLOPs at `peak_flops` x `compute_efficiency`, or its bytes
  at `bandwidth` x `memory_efficiency`, whichever is longer, and at least `min_kernel_s`. FLOPs
  are counted for matrix products and attention (half of the square when causal); bytes are what
  the call reads and writes (an indexed read or write moves the rows it touches, not the table).
  A copy between host and device moves its bytes at `link_bandwidth`.
- A view (a slice too) and an allocation (`empty`) launch nothing: host time only.
- A graph replay costs one launch of host time, and its kernels queue at once.
- A host sync (a value read back, an event or device synchronize, a copy back) waits for every
  stream.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_flatten

MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__", "addmm_"}
INDEXED_READS = {"__getitem__", "index_select", "gather", "embedding", "take"}
INDEXED_WRITES = {"index_put_", "index_copy_", "index_put", "index_copy", "scatter_", "__setitem__"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}  # no kernel: the allocator's
IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                             "and", "or", "xor", "lshift", "rshift")}


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU as the cost model sees it. Peaks are the vendor's dense bfloat16 and memory figures;
    the efficiencies and the host's cost per call are fit (`benchmarks/gpu_forecast.py`)."""
    name: str
    peak_flops: float  # dense bfloat16 tensor-core FLOP/s
    bandwidth: float  # device memory, bytes/s
    link_bandwidth: float = 25e9  # host <-> device copies, bytes/s (PCIe 5 x16, pinned, in practice)
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    host_call_s: float = 9.6e-6
    min_kernel_s: float = 2e-6  # the shortest kernel (a launch's device-side latency)

    def with_fit(self, **fit: float) -> "DeviceSpec":
        return replace(self, **fit)


H100 = DeviceSpec("H100 SXM", peak_flops=989e12, bandwidth=3.35e12)
H200 = DeviceSpec("H200", peak_flops=989e12, bandwidth=4.8e12)


@dataclass
class Timing:
    """What a stretch of recorded work takes on one `DeviceSpec`."""
    elapsed_s: float  # from the first call to the last sync (or kernel)
    host_s: float  # the host's own time: its calls and launches
    compute_s: float  # kernel time where FLOPs bind
    memory_s: float  # kernel time where bytes bind (the per-kernel floor included)
    link_s: float  # copies between host and device
    num_calls: int
    num_kernels: int

    @property
    def binding(self) -> str:
        """The term the elapsed time is closest to: host, compute, memory or link."""
        terms = {"host": self.host_s, "compute": self.compute_s, "memory": self.memory_s, "link": self.link_s}
        return max(terms, key=terms.get)

    def scaled(self, other: "Timing", factor: float) -> "Timing":
        """self + factor x (other - self), term by term: a run of L layers from runs of 1 and 2."""
        def at(a: float, b: float) -> float:
            return a + factor * (b - a)
        return Timing(*(at(getattr(self, f), getattr(other, f)) for f in
                        ("elapsed_s", "host_s", "compute_s", "memory_s", "link_s", "num_calls", "num_kernels")))


class SimClock:
    """The work of a timed simulation (`SimCuda(clock=...)`), recorded as it is issued, so that a
    stretch of it (`record`) is timed on any `DeviceSpec` afterwards (`time_events`)."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        # (kind, flops, bytes, link bytes, stream): kind "call" (a host call and its kernel),
        # "graph" (a kernel of a replay), "replay" (its launch), "sync"
        self.events: list[tuple[str, float, float, float, int]] = []

    def call(self, name: str, args: tuple, kwargs: dict, out, stream: int, is_replaying: bool,
             is_capturing: bool, is_link: bool = False) -> None:
        """One device call (its tensors' data, unwrapped): host time unless a replay runs it; a
        kernel unless it is a view or a capture records it (a capture runs nothing); `is_link`: a
        copy between host and device memory."""
        if is_capturing and not is_replaying:
            self.events.append(("call", 0.0, 0.0, 0.0, stream))
            return
        flops, moved, link = self.work(name, args, kwargs, out, is_link)
        self.events.append(("graph" if is_replaying else "call", flops, moved, link, stream))

    def replay(self) -> None:
        self.events.append(("replay", 0.0, 0.0, 0.0, 0))

    def sync(self) -> None:
        self.events.append(("sync", 0.0, 0.0, 0.0, 0))

    def mark(self) -> int:
        return len(self.events)

    def record(self, run) -> list[tuple[str, float, float, float, int]]:
        """The events of `run()`, from an idle device to the host holding its result."""
        self.sync()
        start = self.mark()
        run()
        self.sync()
        return self.events[start:]

    @staticmethod
    def work(name: str, args: tuple, kwargs: dict, out, is_link: bool = False) -> tuple[float, float, float]:
        """(FLOPs, bytes, bytes across the link) of one call's kernel; zeros for a view."""
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if is_link:
            return 0.0, 0.0, float(max([_bytes(t) for t in ins + outs] or [0]))
        if name in ALLOCATIONS or _is_view(name, ins, outs, kwargs):
            return 0.0, 0.0, 0.0
        return flop_count(name, args, kwargs, ins, outs), byte_count(name, ins, outs), 0.0


def time_events(events: list[tuple[str, float, float, float, int]], spec: DeviceSpec) -> Timing:
    """Recorded events (`SimClock.events`) timed on `spec`, starting with every clock idle."""
    host, streams = 0.0, defaultdict(float)
    out = Timing(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    for kind, flops, moved, link, stream in events:
        if kind in ("call", "replay"):
            host += spec.host_call_s
            out.num_calls += 1
        if kind == "sync":
            host = max([host, *streams.values()])
            continue
        if kind == "replay" or flops == moved == link == 0:
            continue
        compute = flops / (spec.peak_flops * spec.compute_efficiency)
        memory = max(moved / (spec.bandwidth * spec.memory_efficiency), spec.min_kernel_s)
        seconds = link / spec.link_bandwidth if link else max(compute, memory)
        streams[stream] = max(streams[stream], host) + seconds
        out.num_kernels += 1
        if link:
            out.link_s += seconds
        elif compute >= memory:
            out.compute_s += seconds
        else:
            out.memory_s += seconds
    out.host_s = out.num_calls * spec.host_call_s
    out.elapsed_s = max([host, *streams.values()])
    return out


def flop_count(name: str, args: tuple, kwargs: dict, ins: list, outs: list) -> float:
    if name in MATMULS and outs:
        a = ins[1] if name.startswith("addmm") or name == "baddbmm" else ins[0]
        return 2.0 * outs[0].numel() * a.shape[-1]
    if name == "scaled_dot_product_attention" and len(ins) >= 3:
        q, k = ins[0], ins[1]
        batch = math.prod(q.shape[:-2])
        causal = kwargs.get("is_causal", False) or (len(args) > 5 and args[5])
        return 4.0 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1.0)
    return 0.0


def byte_count(name: str, ins: list, outs: list) -> float:
    if name in INDEXED_READS and outs:
        return 2.0 * sum(_bytes(t) for t in outs)
    if name in INDEXED_WRITES and ins:
        return 2.0 * _bytes(ins[-1])
    seen, total = set(), 0.0
    for t in ins + outs:
        if id(t) not in seen:
            seen.add(id(t))
            total += _bytes(t)
    return total


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_in_place(name: str) -> bool:
    # `__getitem__` ends in "_" too: a dunder writes in place only as an augmented assignment
    if name.startswith("__") and name.endswith("__"):
        return name in IN_PLACE_DUNDERS
    return name.endswith("_")


def _is_view(name: str, ins: list, outs: list, kwargs: dict) -> bool:
    if not outs or _is_in_place(name) or "out" in kwargs or name in INDEXED_WRITES:
        return False
    storages = {t.untyped_storage().data_ptr() for t in ins if t.numel()}
    return all(t.numel() == 0 or t.untyped_storage().data_ptr() in storages for t in outs)
