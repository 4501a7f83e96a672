"""The descriptors the decode kernels (`model.native`) read their caches and weights through, checked.

In: the KV caches of a decode step's sequences (`kv_layouts`, once per step) or a model's packed
layer weights (`layer_table`, once per load). Out: `KVLayouts` / `LayerTable`, an int64 table of raw
addresses, lengths and strides for the C side, with what it was checked against (dtype, head
counts, sizes, number of layers) and the tensors it points into, kept alive while it lives.

The C side trusts every address, length and stride, so everything is checked here: a mismatch
raises ValueError naming the argument, what it was and what was expected. A cache's descriptor is
also checked against its tensor's storage: the last element the kernel reads or writes, in the
last layer, lies inside it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NUM_LAYOUT_FIELDS = 10  # the C side's per-sequence descriptor
NUM_WEIGHT_FIELDS = 7  # the C side's per-layer weight addresses
PANEL = 32  # output columns per packed panel (the C side's PANEL)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def require(is_ok: bool, what: str, name: str, got: object, expected: object) -> None:
    """ValueError "<what>: <name> is <got>, expected <expected>" unless `is_ok`."""
    if not is_ok:
        raise ValueError(f"{what}: {name} is {got}, expected {expected}")


def _check_table(table: torch.Tensor, num_fields: int, name: str) -> None:
    if not (table.dtype == torch.int64 and table.device.type == "cpu" and table.is_contiguous()
            and table.ndim == 2 and table.shape[1] == num_fields):
        raise ValueError(f"native descriptor: {name} is {tuple(table.shape)} {table.dtype} on {table.device} "
                         f"(contiguous: {table.is_contiguous()}), expected a contiguous int64 CPU tensor "
                         f"[rows, {num_fields}]")


@dataclass(frozen=True)
class KVLayouts:
    """Each sequence's keys and values for the C side (`kv_layouts`)."""
    table: torch.Tensor  # [num_seqs, NUM_LAYOUT_FIELDS] int64
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    num_layers: int
    tensors: tuple[torch.Tensor, ...] = ()  # what the addresses point into

    def __post_init__(self) -> None:
        _check_table(self.table, NUM_LAYOUT_FIELDS, "layouts")

    @property
    def num_seqs(self) -> int:
        return self.table.shape[0]


def _last_offset(t: torch.Tensor, num_rows: int, num_layers: int, layer_stride: int) -> int:
    """Storage offset (in elements) of the last element the kernel touches in `t` [T, Hkv, D]."""
    return (t.storage_offset() + (num_layers - 1) * layer_stride + (num_rows - 1) * t.stride(0)
            + (t.shape[1] - 1) * t.stride(1) + (t.shape[2] - 1) * t.stride(2))


def _cache_mismatch(j: int, k: torch.Tensor, v: torch.Tensor, n: int, strides: tuple[int, int],
                    num_layers: int, first: torch.Tensor) -> str | None:
    """What of sequence j's cache the kernel would misread, or None. Plain compares first: a decode
    step checks every sequence."""
    if k.ndim != 3 or k.device.type != "cpu" or k.dtype not in KERNEL_DTYPES:
        return f"keys[{j}] is {tuple(k.shape)} {k.dtype} on {k.device}, expected a CPU float32 or bfloat16 tensor [capacity, Hkv, D]"
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        return f"values[{j}] is {tuple(v.shape)} {v.dtype}, expected the keys' {tuple(k.shape)} {k.dtype}"
    if k.shape[1:] != first.shape[1:] or k.dtype != first.dtype:
        return (f"keys[{j}] is [*, {k.shape[1]}, {k.shape[2]}] {k.dtype}, expected keys[0]'s "
                f"[*, {first.shape[1]}, {first.shape[2]}] {first.dtype}: one step's caches share a layout")
    if k.stride(2) != 1 or v.stride(2) != 1:
        return f"keys[{j}] / values[{j}] element stride is {(k.stride(2), v.stride(2))}, expected 1 (contiguous within a head)"
    if not 0 < n <= k.shape[0]:
        return f"num_keys[{j}] is {n}, expected 1 to the cache's capacity {k.shape[0]}"
    if min(strides) < 0 or (num_layers > 1 and min(strides) == 0):
        return f"layer_strides[{j}] is {strides}, expected positive strides for {num_layers} layers"
    for name, t, stride in (("keys", k, strides[0]), ("values", v, strides[1])):
        size, last = t.untyped_storage().nbytes() // t.element_size(), _last_offset(t, n, num_layers, stride)
        if last >= size:
            return f"{name}[{j}] over {num_layers} layers is reaching element {last}, expected within its storage of {size}"
    return None


def kv_layouts(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], num_keys: Sequence[int],
               layer_strides: Sequence[tuple[int, int]] | None = None, num_layers: int = 1) -> KVLayouts:
    """The descriptor of each sequence's layer-0 keys and values [capacity, Hkv, D] (any token and
    head strides, unit stride within a head), its number of keys, and its (key, value) layer strides
    in elements over `num_layers` layers (None: one layer)."""
    if not len(keys) == len(values) == len(num_keys) > 0:
        raise ValueError(f"native attention: keys / values / num_keys is {len(keys)} / {len(values)} / "
                         f"{len(num_keys)} entries, expected one each per sequence, at least one")
    if num_layers < 1 or (layer_strides is None and num_layers > 1):
        raise ValueError(f"native attention: layer_strides is {layer_strides}, expected one (key, value) pair "
                         f"per sequence for {num_layers} layers")
    strides = [(0, 0)] * len(keys) if layer_strides is None else layer_strides
    if len(strides) != len(keys):
        raise ValueError(f"native attention: layer_strides is {len(strides)} entries, expected {len(keys)}, "
                         "one per sequence")
    rows = []
    for j, (k, v, n, (k_layer, v_layer)) in enumerate(zip(keys, values, num_keys, strides)):
        mismatch = _cache_mismatch(j, k, v, n, (k_layer, v_layer), num_layers, keys[0])
        if mismatch is not None:
            raise ValueError(f"native attention: {mismatch}")
        rows.append([k.data_ptr(), v.data_ptr(), n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     k_layer, v_layer, 0])
    return KVLayouts(torch.tensor(rows, dtype=torch.int64), keys[0].dtype, keys[0].shape[1], keys[0].shape[2],
                     num_layers, (*keys, *values))


def packed_dims(packed: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a weight packed by `native.pack` (float32 [out/32, in, 32]; bfloat16
    [out/32, in/2, 32, 2])."""
    if packed.dtype == torch.bfloat16 and packed.ndim == 4:
        return packed.shape[0] * PANEL, packed.shape[1] * 2
    return packed.shape[0] * PANEL, packed.shape[1] if packed.ndim == 3 else -1


@dataclass(frozen=True)
class LayerTable:
    """Every decoder layer's weights for the C side (`layer_table`), and the shapes they fit."""
    table: torch.Tensor  # [num_layers, NUM_WEIGHT_FIELDS] int64
    dtype: torch.dtype
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    tensors: tuple[torch.Tensor, ...] = ()  # what the addresses point into

    def __post_init__(self) -> None:
        _check_table(self.table, NUM_WEIGHT_FIELDS, "table")
        require(self.num_heads > 0 and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
                "native decode layers", "num_heads / num_kv_heads", (self.num_heads, self.num_kv_heads),
                "positive, the first a multiple of the second")

    @property
    def num_layers(self) -> int:
        return self.table.shape[0]


def _check_layer(i: int, weights: tuple, dtype: torch.dtype, dims: dict[str, tuple[int, int]],
                 hidden: int) -> None:
    what = "native decode layers"
    for name, t in zip(("qkv", "o", "gate_up", "down"), weights[:4]):
        require(t is not None and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
                and packed_dims(t) == dims[name], what, f"layers[{i}].{name}",
                None if t is None else f"{tuple(t.shape)} {t.dtype} (out, in = {packed_dims(t)})",
                f"a contiguous packed {dtype} weight of (out, in) = {dims[name]}")
    for name, t, size in (("qkv_bias", weights[4], dims["qkv"][0]), ("input_norm", weights[5], hidden),
                          ("post_norm", weights[6], hidden)):
        if t is None and name == "qkv_bias":
            continue
        require(t is not None and t.dtype == dtype and t.is_contiguous() and t.shape == (size,), what,
                f"layers[{i}].{name}", None if t is None else f"{tuple(t.shape)} {t.dtype}",
                f"a contiguous {dtype} vector of {size}")


def layer_table(layers: Sequence[tuple[torch.Tensor | None, ...]], *, hidden: int, num_heads: int,
                num_kv_heads: int, head_dim: int, intermediate: int, eps: float) -> LayerTable:
    """The descriptor of every layer's packed qkv, o, gate|up and down weights (`native.pack`), its
    qkv bias (or None) and its input and post-attention norm weights, checked against the shapes."""
    require(len(layers) > 0 and all(len(w) == NUM_WEIGHT_FIELDS for w in layers), "native decode layers",
            "layers", [len(w) for w in layers], f"at least one layer of {NUM_WEIGHT_FIELDS} weights each")
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    dims = {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size), "gate_up": (2 * intermediate, hidden),
            "down": (hidden, intermediate)}
    dtype = layers[0][0].dtype
    require(dtype in KERNEL_DTYPES, "native decode layers", "layers[0].qkv dtype", dtype, "float32 or bfloat16")
    for i, weights in enumerate(layers):
        _check_layer(i, weights, dtype, dims, hidden)
    table = torch.tensor([[0 if t is None else t.data_ptr() for t in w] for w in layers], dtype=torch.int64)
    return LayerTable(table, dtype, hidden, num_heads, num_kv_heads, head_dim, intermediate, eps,
                      tuple(t for w in layers for t in w if t is not None))
