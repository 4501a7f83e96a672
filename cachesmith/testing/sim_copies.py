"""The torch calls whose device semantics differ from running the op on the data: copies between
host and device, factories of host data, pinned memory, and which SDPA kernel CUDA would pick.

In: the simulation (`sim_cuda.SimCuda`: it counts and checks), the call and its arguments. Out:
the call's result, or `NotImplemented` when the call is an ordinary op after all.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from cachesmith.testing.sim_kernels import sdpa_choice_for_call
from cachesmith.testing.sim_streams import span_of
from cachesmith.testing.sim_tensor import CPU, SimTensor, _is_cuda, _name, _unwrap


def sdpa_kernel(args: tuple, kwargs: dict) -> str:
    """Which kernel torch's CUDA SDPA picks for this call on an H100 (`sim_kernels`: torch's rules)."""
    return sdpa_choice_for_call(tree_map(_unwrap, args), tree_map(_unwrap, kwargs))[0]


# -- calls whose device semantics differ from running the op on the data ------------------------

def _into_device(sim, dst: torch.Tensor, src: torch.Tensor, is_non_blocking: bool, what: str) -> None:
    """Host `src` into `dst` (a device tensor's data) on the current stream. Non-blocking from
    pinned memory, it lands later and reads `src` then; blocking, the host waits for the stream."""
    sim.h2d(src, is_non_blocking, what)
    if sim.is_in_graph:  # a memcpy node of the graph: it reads the pinned buffer when replayed
        sim.before_graph_write(dst)
        dst.copy_(src)
        return
    key = sim.memory.key(dst)
    if is_non_blocking and sim.is_pinned(src):
        sim.order.issue_copy(dst, src, key, span_of(dst), is_to_host=False)
        return
    sim.order.land({key})
    dst.copy_(src)
    sim.order.op(what, {}, {key: [span_of(dst)]}, set())
    if not is_non_blocking:  # torch's blocking copy synchronizes its stream
        sim.order.host_waited_for(sim.order.current())


def _to_host(sim, dst: torch.Tensor, src: SimTensor, is_non_blocking: bool, what: str, is_sync_counted: bool) -> None:
    """Device `src` into host `dst`. Non-blocking into pinned memory, `dst` holds poison until an
    event or sync covering the copy is waited for; otherwise the host waits for the stream."""
    sim.d2h(what)
    key = sim.memory.key(src.elem)
    if is_non_blocking and sim.is_pinned(dst):
        sim.order.issue_copy(dst, src.elem, key, span_of(src.elem), is_to_host=True)
        return
    if is_sync_counted:
        sim.sync(what)
    sim.order.land({key})
    sim.order.op(what, {key: [span_of(src.elem)]}, {}, set())
    sim.order.host_waited_for(sim.order.current())
    dst.copy_(src.elem)


def _to(sim, func, args, kwargs, sims):
    src = args[0]
    copy = bool(kwargs.get("copy", False))  # `_parse_to` takes no `copy` (transformers passes it)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                          if k != "copy"})
    if isinstance(src, SimTensor):
        if device is not None and device.type == "cpu":
            # non-blocking, torch pins the destination and returns before the copy has run
            out = torch.empty(src.shape, dtype=dtype or src.dtype, pin_memory=non_blocking)
            _to_host(sim, sim.pin(out) if non_blocking else out, src, non_blocking, "to(cpu)", False)
            return out
        if dtype is None or dtype == src.dtype:
            return SimTensor(src.elem.clone()) if copy else src
        return NotImplemented  # a conversion on the device: an ordinary op
    if _is_cuda(device):
        out = SimTensor(torch.empty(src.shape, dtype=dtype or src.dtype))
        _into_device(sim, out.elem, src, non_blocking, "to(cuda)")
        return out
    return NotImplemented


def _cuda(sim, func, args, kwargs, sims):
    src = args[0]
    if isinstance(src, SimTensor):
        return src
    out = SimTensor(torch.empty_like(src))
    _into_device(sim, out.elem, src, bool(kwargs.get("non_blocking", False)), "cuda()")
    return out


def _cpu(sim, func, args, kwargs, sims):
    out = torch.empty_like(args[0].elem)
    _to_host(sim, out, args[0], False, "cpu()", False)
    return out


def _copy_(sim, func, args, kwargs, sims):
    dst, src = args[0], args[1]
    non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    if isinstance(dst, SimTensor) and not isinstance(src, SimTensor) and isinstance(src, torch.Tensor):
        if src.dim() > 0 or src.numel() > 0:
            _into_device(sim, dst.elem, src, non_blocking, "copy_ into a device tensor")
        else:  # a 0-dim host scalar is an argument of a fill, not a copy
            return NotImplemented
        return dst
    if isinstance(src, SimTensor) and not isinstance(dst, SimTensor):
        # non-blocking into pageable memory, CUDA copies through a staging buffer and waits
        _to_host(sim, dst, src, non_blocking, "copy_ into a host tensor", True)
        return dst
    return NotImplemented


def _factory(sim, func, args, kwargs, sims):
    """`torch.tensor` / `as_tensor` of host data onto the device is a host -> device copy."""
    if not _is_cuda(kwargs.get("device")):
        return NotImplemented
    data = args[0] if args else kwargs.get("data")
    if isinstance(data, SimTensor):
        return NotImplemented
    sim.h2d(data if isinstance(data, torch.Tensor) else None, False, f"torch.{_name(func)} onto the device")
    out = func(*tree_map(_unwrap, args), **{**kwargs, "device": CPU})
    return SimTensor(out if out is not data else out.clone())


def _pin_memory(sim, func, args, kwargs, sims):
    return NotImplemented if sims else sim.pin(args[0].clone())


def _is_pinned(sim, func, args, kwargs, sims):
    return False if sims else sim.is_pinned(args[0])


def _shallow_copy_type(sim, func, args, kwargs, sims):
    """`nn.Module.to` asks whether it may swap a parameter's `.data` for the moved tensor; a device
    tensor of the simulation never may, so the module takes the moved tensor itself."""
    return False


SPECIAL: dict[str, Callable] = {"_has_compatible_shallow_copy_type": _shallow_copy_type, "to": _to, "cuda": _cuda, "cpu": _cpu, "copy_": _copy_, "tensor": _factory,
                                 "as_tensor": _factory, "asarray": _factory, "pin_memory": _pin_memory,
                                 "is_pinned": _is_pinned}
