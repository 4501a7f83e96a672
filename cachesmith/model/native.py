"""Decode kernels compiled for the CPU they run on (`csrc/`, C with AVX-512): small-row matmuls,
decoding rows' attention, and every decoder layer of a decode step in one call.

In / out:
- `pack(weight [out, in])` once at load, then `matmul(x [num_rows, in], packed)` -> `[num_rows, out]`,
  equal to `F.linear` up to float32 summation order (bfloat16: accumulated in float32, rounded once);
- `decode_attention(q [num_seqs, H, D], num_kv_heads, kv_layouts(...), layer)` -> `[num_seqs, H * D]`,
  each sequence's row over its own cache, equal to SDPA up to float32 rounding (`attend_one`: one row);
- `decode_layers(h [num_seqs, hidden], layer_table(...), kv_layouts(...), cos, sin)`: the
  residual stream after every layer, rounding where torch's per-op path rounds.

Why: one decoding row costs reading every weight once, and the libraries torch calls read one row's
weights well below what the memory delivers. On a 2-core AVX-512 machine here, a weight from memory
(90 distinct weights a pass, 2 threads) was read by oneDNN's prepacked kernel at 14-25 GB/s and by
`F.linear` at 8-17 GB/s; `torch.sum` reads the same bytes at 28-34. The matmul here ran 1.4-2.5x
oneDNN's speed at 1-2 rows, 1.2-1.8x at 4, 1.1-1.5x at 8, 0.8-1.1x at 16 and 0.8-1.0x at 32.
One row's attention through torch's CPU flash kernel (3 KV heads of 64 over 1K-4K cached keys) read
the keys and values at 4-13 GB/s: its tasks are (head, query block) pairs, so 3 heads on 2 threads
take two rounds, and each block of keys is packed before its matmul. The kernel here splits the
keys, not the heads, over the threads: 1.5-2.8x faster at 100-4K keys. And a step's Python between
the kernels (norms, RoPE, views, residual adds: 6-7 ms of a 19 ms bfloat16 step at 1K) is gone when
every layer runs in one call. Whether a model's calls go here is measured at load
(`model.linear.tune_native`, `model.row_attention.tune_native_attention`).

The library is compiled on first use with the system's C compiler (`cc`, `-march=native`, OpenMP:
torch's own OpenMP runtime is already loaded, so both share its threads) by `model.native_build`.
Without a compiler, AVX-512 or a writable cache, nothing fails: `library()` is None and torch's
kernels serve every call.

The C side trusts every pointer, length and stride it is given, so everything that becomes one is
checked here first and a mismatch raises ValueError naming the argument and what was expected:
the caches' bounds and layouts when `kv_layouts` builds their descriptor (once per step), the
weights' shapes when `layer_table` builds theirs (once per load), and, per call, only how the
arguments agree with those descriptors. A kernel that cannot allocate its scratch raises MemoryError.
"""
from __future__ import annotations

import torch

from cachesmith.model.native_build import library
from cachesmith.model.native_descriptors import (  # noqa: F401  (re-exported: the kernels' API)
    NUM_LAYOUT_FIELDS, NUM_WEIGHT_FIELDS, PANEL, KVLayouts, LayerTable, kv_layouts, layer_table, packed_dims)

# The matmul alone, against oneDNN: 1.1-2.5x at up to 8 rows (timed at load at 1 and TUNED_ROWS
# rows), even at 16 (0.8-1.1x), slower at 32. Up to 16 rows go native all the same: a step of 16
# streams then runs every layer in one call (`decode_layers`), 1.2-1.5x the tokens/s of the
# per-layer path through oneDNN here.
MAX_NATIVE_ROWS = 16
TUNED_ROWS = 8
_KERNEL_BITS = {torch.float32: 1, torch.bfloat16: 2}
_SYMBOLS = {torch.float32: "cs_matmul_f32", torch.bfloat16: "cs_matmul_bf16"}
_ATTEND_SYMBOLS = {torch.float32: "cs_decode_attention_f32", torch.bfloat16: "cs_decode_attention_bf16"}
_LAYERS_SYMBOLS = {torch.float32: "cs_decode_layers_f32", torch.bfloat16: "cs_decode_layers_bf16"}


def supports(dtype: torch.dtype) -> bool:
    """Whether this CPU has the kernel for `dtype` (float32: AVX-512; bfloat16: also AVX512_BF16)."""
    lib = library()
    return lib is not None and dtype in _KERNEL_BITS and bool(lib.cs_kernels() & _KERNEL_BITS[dtype])


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] -> the kernel's panels (float32 [out/32, in, 32]; bfloat16 [out/32, in/2, 32, 2]),
    or None where no kernel applies."""
    if weight.device.type != "cpu" or weight.ndim != 2 or not supports(weight.dtype):
        return None
    num_out, num_in = weight.shape
    if num_out % PANEL or (weight.dtype == torch.bfloat16 and num_in % 2):
        return None
    if weight.dtype == torch.float32:
        return weight.reshape(num_out // PANEL, PANEL, num_in).transpose(1, 2).contiguous()
    return weight.reshape(num_out // PANEL, PANEL, num_in // 2, 2).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_rows, in] @ the packed weight -> [num_rows, out] (+ bias)."""
    num_out, num_in = packed_dims(packed)
    if x.ndim != 2 or x.shape[1] != num_in or x.dtype != packed.dtype or x.device.type != "cpu":
        # the kernel reads raw memory: a wrong shape would read past the tensor, not raise
        raise ValueError(f"native matmul: x {tuple(x.shape)} {x.dtype} does not fit a weight of "
                         f"[{num_out}, {num_in}] {packed.dtype}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], num_out, dtype=x.dtype)  # [num_rows, out]
    kernel = getattr(library(), _SYMBOLS[x.dtype])
    kernel(packed.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], num_out, num_in, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def supports_attention(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode attention runs natively for this dtype and head size (AVX-512; head_dim a
    multiple of 16)."""
    lib = library()
    return lib is not None and hasattr(lib, _ATTEND_SYMBOLS.get(dtype, "")) and head_dim > 0 and head_dim % 16 == 0


def _attention_mismatch(q: torch.Tensor, num_kv_heads: int, layouts: KVLayouts, layer: int,
                        k_new: torch.Tensor | None, v_new: torch.Tensor | None) -> str | None:
    """What of a `decode_attention` call does not fit its layouts, or None. Plain compares: this
    runs once per layer of every decode step."""
    if not isinstance(layouts, KVLayouts):
        return f"layouts is a {type(layouts).__name__}, expected native.KVLayouts (from kv_layouts)"
    if q.ndim != 3 or q.shape[0] != layouts.num_seqs or q.shape[2] != layouts.head_dim:
        return (f"q is {tuple(q.shape)}, expected [{layouts.num_seqs}, H, {layouts.head_dim}] "
                "(the layouts' sequences, head size)")
    if q.dtype != layouts.dtype or q.device.type != "cpu":
        return f"q is {q.dtype} on {q.device}, expected the caches' {layouts.dtype} on cpu"
    if num_kv_heads != layouts.num_kv_heads or q.shape[1] % num_kv_heads:
        return (f"num_kv_heads is {num_kv_heads}, expected the caches' {layouts.num_kv_heads}, dividing "
                f"q's {q.shape[1]} heads")
    if not 0 <= layer < layouts.num_layers:
        return f"layer is {layer}, expected 0 to {layouts.num_layers - 1} (the caches' layers)"
    if (k_new is None) != (v_new is None):
        return "k_new and v_new are one given, one None, expected both or neither"
    expected = (layouts.num_seqs, layouts.num_kv_heads, layouts.head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t is not None and (t.shape != expected or t.dtype != q.dtype or t.device.type != "cpu"):
            return f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected {list(expected)} {q.dtype} on cpu"
    if not supports_attention(q.dtype, layouts.head_dim):
        return (f"head size is {layouts.head_dim} in {q.dtype}, expected a multiple of 16 in a dtype "
                "this CPU's kernels take")
    return None


def _raise_if_short(num_bytes: int, what: str) -> None:
    if num_bytes:
        raise MemoryError(f"{what}: could not allocate {num_bytes} bytes of scratch memory")


def decode_attention(q: torch.Tensor, num_kv_heads: int, layouts: KVLayouts, layer: int = 0,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's rotated queries q [num_seqs, H, D] over its keys and values in layer `layer`
    (`kv_layouts`) -> softmax(q k^T / sqrt(D)) v as [num_seqs, H * D]. Given k_new and
    v_new [num_seqs, Hkv, D], each is first written as its sequence's last key and value (row
    num_keys - 1)."""
    mismatch = _attention_mismatch(q, num_kv_heads, layouts, layer, k_new, v_new)
    if mismatch is not None:
        raise ValueError(f"native attention: {mismatch}")
    num_seqs, num_heads, head_dim = q.shape
    q = q.contiguous()
    k_new, v_new = (None, None) if k_new is None else (k_new.contiguous(), v_new.contiguous())
    out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype)  # [num_seqs, H * D]
    kernel = getattr(library(), _ATTEND_SYMBOLS[q.dtype])
    _raise_if_short(kernel(q.data_ptr(), None if k_new is None else k_new.data_ptr(),
                           None if v_new is None else v_new.data_ptr(), out.data_ptr(), layouts.table.data_ptr(),
                           num_seqs, layer, num_kv_heads, num_heads // num_kv_heads, head_dim, head_dim ** -0.5,
                           torch.get_num_threads()), "native attention")
    return out


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row's rotated queries q [H, D] over keys, values [T, Hkv, D] (any token and head strides,
    unit stride within a head) -> softmax(q k^T / sqrt(D)) v as [H * D]."""
    layouts = kv_layouts([keys], [values], [keys.shape[0]])
    return decode_attention(q[None], layouts.num_kv_heads, layouts)[0]


def supports_layers(dtype: torch.dtype) -> bool:
    """Whether `decode_layers` runs natively for this dtype."""
    lib = library()
    return lib is not None and hasattr(lib, _LAYERS_SYMBOLS.get(dtype, ""))


def _layers_mismatch(h: torch.Tensor, table: LayerTable, layouts: KVLayouts, cos: torch.Tensor,
                     sin: torch.Tensor) -> str | None:
    """What of a `decode_layers` call does not fit its weights and caches, or None."""
    if not isinstance(table, LayerTable) or not isinstance(layouts, KVLayouts):
        return (f"table and layouts are a {type(table).__name__} and a {type(layouts).__name__}, expected "
                "native.LayerTable and native.KVLayouts")
    if h.ndim != 2 or h.shape != (layouts.num_seqs, table.hidden) or not h.is_contiguous():
        return f"h is {tuple(h.shape)}, expected contiguous [{layouts.num_seqs}, {table.hidden}] (sequences, hidden)"
    if h.dtype != table.dtype or layouts.dtype != table.dtype or h.device.type != "cpu":
        return (f"h and the caches are {h.dtype} and {layouts.dtype} on {h.device}, expected the weights' "
                f"{table.dtype} on cpu")
    if (layouts.num_kv_heads, layouts.head_dim) != (table.num_kv_heads, table.head_dim):
        return (f"the caches' (KV heads, head size) is {(layouts.num_kv_heads, layouts.head_dim)}, expected the "
                f"weights' {(table.num_kv_heads, table.head_dim)}")
    if layouts.num_layers < table.num_layers:
        return f"the caches hold {layouts.num_layers} layers, expected at least the weights' {table.num_layers}"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (layouts.num_seqs, table.head_dim) or t.dtype != h.dtype or not t.is_contiguous():
            return (f"{name} is {tuple(t.shape)} {t.dtype}, expected contiguous "
                    f"[{layouts.num_seqs}, {table.head_dim}] {h.dtype}")
    if not (supports_layers(h.dtype) and supports_attention(h.dtype, table.head_dim)):
        return f"dtype {h.dtype} with head size {table.head_dim} has no kernel on this CPU"
    return None


def decode_layers(h: torch.Tensor, table: LayerTable, layouts: KVLayouts, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Every layer of one decode step (csrc/decode_layers.c): the residual stream h [num_seqs, hidden]
    of each sequence, updated in place and returned, each sequence's new K/V written into its cache
    (`kv_layouts`, whose rows num_keys - 1 are the new ones). cos, sin [num_seqs, head_dim] are the
    sequences' rotary tables in h's dtype; the weights (`layer_table`) are h's dtype too."""
    mismatch = _layers_mismatch(h, table, layouts, cos, sin)
    if mismatch is not None:
        raise ValueError(f"native decode layers: {mismatch}")
    kernel = getattr(library(), _LAYERS_SYMBOLS[h.dtype])
    _raise_if_short(kernel(h.data_ptr(), table.table.data_ptr(), layouts.table.data_ptr(), cos.data_ptr(),
                           sin.data_ptr(), h.shape[0], table.num_layers, table.hidden, table.num_heads,
                           table.num_kv_heads, table.head_dim, table.intermediate, table.eps,
                           torch.get_num_threads()), "native decode layers")
    return h
