"""What the simulated CUDA device counts, and how it sorts torch calls: which are metadata, which
make the host wait, which raise, which copy host data in, and which device memory a call reads and
writes.

In: a torch call's name and arguments. Out: `Counts` (a region's costs), the call tables
`sim_cuda` dispatches on, and the storages and byte spans a call touches (`spans`, `written`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch.utils._pytree import tree_flatten

from cachesmith.testing.sim_streams import span_of
from cachesmith.testing.sim_tensor import SimTensor


@dataclass
class Counts:
    """What the device work of one region cost."""
    ops: int = 0  # torch calls on device tensors (metadata reads excluded)
    syncs: int = 0  # the host waited for the device
    d2h: int = 0  # device -> host copies
    h2d: int = 0  # host -> device copies
    findings: list[str] = field(default_factory=list)  # legal but slow on a GPU
    attention: Counter = field(default_factory=Counter)  # SDPA calls by the kernel CUDA would run
    sync_sites: list[str] = field(default_factory=list)  # what synced (names), for messages
    captures: int = 0  # CUDA graph captures (each one a device sync and an emptied cache)
    replays: int = 0  # CUDA graph replays (one launch each)
    cache_empties: int = 0  # the caching allocator emptied (`empty_cache`, a capture)

    @property
    def stream_findings(self) -> list[str]:
        return [f for f in self.findings if f.startswith("stream:")]



# property reads answered by the wrapper itself (its metadata is the device tensor's)
_OWN_PROPERTIES = {"device", "is_cuda", "is_cpu", "dtype", "shape", "ndim", "layout", "requires_grad",
                   "is_leaf", "grad_fn", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested",
                   "names", "output_nr", "_version", "grad", "is_inference"}
_METADATA = {"size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "element_size", "nelement",
             "__len__", "is_floating_point", "is_complex", "__get__", "get_device", "is_inference",
             "__hash__", "is_pinned", "__format__"}
_SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "equal",
          "masked_select", "unique", "unique_consecutive", "allclose", "__array__", "__iter__"}
_RAISES = {"numpy": "`.numpy()` of a device tensor: a host view of device memory does not exist",
           "data_ptr": "a device pointer handed to host code (a native C kernel reads host memory)",
           "untyped_storage": "the storage of a device tensor read on the host"}
_COPIES_IN = {"tensor", "as_tensor", "from_numpy", "asarray"}  # build from host data
_HOST_SPECIAL = _COPIES_IN | {"pin_memory", "is_pinned", "to", "cuda", "copy_"}  # special even with no device tensor
_INDEXED = {"__getitem__", "__setitem__"}  # CPU index tensors are allowed (copied to the device)


def spans(tensors: list[SimTensor]) -> dict[int, list]:
    """The storages these device tensors reach, and which bytes of each."""
    out: dict[int, list] = {}
    for t in tensors:
        key = t.elem.untyped_storage().data_ptr()
        if key:
            out.setdefault(key, []).append(span_of(t.elem))
    return out


def written(name: str, args: tuple, kwargs: dict) -> list[SimTensor]:
    """The device tensors a call writes in place: its first argument for `add_`, `copy_`,
    `__setitem__`, `__iadd__`..., and any `out=`."""
    is_in_place = (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__iter__"))
    out = [args[0]] if is_in_place and args and isinstance(args[0], SimTensor) else []
    return out + [t for t in tree_flatten(kwargs.get("out"))[0] if isinstance(t, SimTensor)]
