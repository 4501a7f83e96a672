"""The simulated CUDA device's tensor: CPU data reported as `cuda:0`, and the helpers every part of
the simulation shares (unwrapping, names of torch calls).

In: a CPU tensor. Out: a `SimTensor` whose every torch call goes to the simulation that is on
(`sim_cuda.SimCuda`, which sets `_active`), and raises outside it.
"""
from __future__ import annotations

from typing import Any

import torch

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


class SimCudaError(RuntimeError):
    """What a real CUDA device would have raised."""


_active: list[Any] = [None]  # the simulation that is on (one at a time), set by `SimCuda`


class SimTensor(torch.Tensor):
    """A device tensor of the simulation: CPU data in `elem`, `cuda:0` everywhere it shows."""
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "SimTensor":
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=CUDA0, requires_grad=elem.requires_grad)
        out.elem = elem
        if _active[0] is not None:
            _active[0].allocated(elem)  # device memory: counted against the capacity
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise SimCudaError(f"{func} reached the dispatcher with a simulated device tensor")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        sim = _active[0]
        if sim is None:
            raise SimCudaError(f"{getattr(func, '__name__', func)} on a simulated device tensor outside the simulation")
        return sim.handle(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None) -> str:  # printing reads the values back
        if _active[0] is not None:
            _active[0].sync("repr")
        return f"SimTensor(cuda:0, {self.elem!r})"


def _name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return f"get:{getattr(owner, '__name__', '?')}"
    return name


def _unwrap(x):
    return x.elem if isinstance(x, SimTensor) else x


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"
