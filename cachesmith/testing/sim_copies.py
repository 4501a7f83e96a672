"""The torch calls whose device semantics differ from running the op on the data: copies between
host and device, factories of host data, pinned memory, and which SDPA kernel CUDA would pick.

In: the simulation (`sim_cuda.SimCuda`: it counts and checks), the call and its arguments. Out:
the call's result, or `NotImplemented` when the call is an ordinary op after all.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from cachesmith.testing.sim_tensor import CPU, SimTensor, _is_cuda, _name, _unwrap


def sdpa_kernel(args: tuple, kwargs: dict) -> str:
    """Which kernel torch's CUDA SDPA picks for these inputs: the flash kernel takes no mask and
    half precision; the memory-efficient one takes a mask but not `enable_gqa`; else math."""
    q = args[0]
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    is_gqa = bool(kwargs.get("enable_gqa", False)) and q.shape[-3] != args[1].shape[-3]
    if mask is not None and is_gqa:
        return "math"
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "efficient" if not is_gqa else "math"


# -- calls whose device semantics differ from running the op on the data ------------------------

def _to(sim, func, args, kwargs, sims):
    src = args[0]
    copy = bool(kwargs.get("copy", False))  # `_parse_to` takes no `copy` (transformers passes it)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                          if k != "copy"})
    if isinstance(src, SimTensor):
        if device is not None and device.type == "cpu":
            sim.d2h("to(cpu)")
            return src.elem.to(dtype=dtype or src.dtype, copy=True)
        if dtype is None or dtype == src.dtype:
            return SimTensor(src.elem.clone()) if copy else src
        sim._add(ops=1)
        return SimTensor(src.elem.to(dtype))
    if _is_cuda(device):
        sim.h2d(src, non_blocking, "to(cuda)")
        return SimTensor(src.to(dtype=dtype or src.dtype, copy=True))
    return NotImplemented


def _cuda(sim, func, args, kwargs, sims):
    src = args[0]
    if isinstance(src, SimTensor):
        return src
    sim.h2d(src, bool(kwargs.get("non_blocking", False)), "cuda()")
    return SimTensor(src.clone())


def _cpu(sim, func, args, kwargs, sims):
    sim.d2h("cpu()")
    return args[0].elem.clone()


def _copy_(sim, func, args, kwargs, sims):
    dst, src = args[0], args[1]
    non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    if isinstance(dst, SimTensor) and not isinstance(src, SimTensor) and isinstance(src, torch.Tensor):
        if src.dim() > 0 or src.numel() > 0:
            sim.h2d(src, non_blocking, "copy_ into a device tensor")
        dst.elem.copy_(src)
        return dst
    if isinstance(src, SimTensor) and not isinstance(dst, SimTensor):
        sim.d2h("copy_ into a host tensor")
        if not non_blocking or not sim.is_pinned(dst):
            sim.sync("copy_ into a host tensor")
        dst.copy_(src.elem)
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
