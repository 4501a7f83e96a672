"""Decode kernels compiled for the CPU they run on (`csrc/`, C with AVX-512): small-row matmuls,
decoding rows' attention, and every decoder layer of a decode step in one call.

In / out:
- `pack(weight [out, in])` once at load, then `matmul(x [num_rows, in], packed)` -> `[num_rows, out]`,
  equal to `F.linear` up to float32 summation order (bfloat16: accumulated in float32, rounded once);
- `decode_attention(q [num_seqs, H, D], num_kv_heads, kv_layouts(...), layer)` -> `[num_seqs, H * D]`,
  each sequence's row over its own cache, equal to SDPA up to float32 rounding (`attend_one`: one row);
- `decode_layers(h [num_seqs, hidden], layer_table(...), kv_layouts(...), cos, sin, ...)`: the
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
torch's own OpenMP runtime is already loaded, so both share its threads) into a per-user cache
(`$CACHESMITH_HOME/native`) keyed by the sources, the compiler and the CPU. Without a compiler,
AVX-512 or a writable cache, nothing fails: `library()` is None and torch's kernels serve every call.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from cachesmith.model.assets import cachesmith_home

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(_CSRC / name for name in ("small_rows.c", "one_row_attention.c", "decode_layers.c"))
HEADERS = (_CSRC / "simd_math.h",)
# The matmul alone, against oneDNN: 1.1-2.5x at up to 8 rows (timed at load at 1 and TUNED_ROWS
# rows), even at 16 (0.8-1.1x), slower at 32. Up to 16 rows go native all the same: a step of 16
# streams then runs every layer in one call (`decode_layers`), 1.2-1.5x the tokens/s of the
# per-layer path through oneDNN here.
MAX_NATIVE_ROWS = 16
TUNED_ROWS = 8
PANEL = 32  # output columns per packed panel (the C side's PANEL)
_KERNEL_BITS = {torch.float32: 1, torch.bfloat16: 2}
_SYMBOLS = {torch.float32: "cs_matmul_f32", torch.bfloat16: "cs_matmul_bf16"}
_ATTEND_SYMBOLS = {torch.float32: "cs_decode_attention_f32", torch.bfloat16: "cs_decode_attention_bf16"}
NUM_LAYOUT_FIELDS = 10  # the C side's per-sequence descriptor (see `kv_layouts`)
_LAYERS_SYMBOLS = {torch.float32: "cs_decode_layers_f32", torch.bfloat16: "cs_decode_layers_bf16"}
NUM_WEIGHT_FIELDS = 7  # the C side's per-layer weight addresses (see `layer_table`)


def cache_dir() -> Path:
    return cachesmith_home() / "native"


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _build_key(compiler: str) -> str:
    """Source, compiler version and CPU: -march=native code is only valid on the CPU it targets."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = platform.processor() + platform.machine()
    try:
        cpu += next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    return hashlib.sha256(sources + version.encode() + cpu.encode()).hexdigest()[:16]


def build(out_dir: Path, compiler: str) -> Path:
    """Compile the kernels into `out_dir` (atomically: a half-written library is never loaded)."""
    target = out_dir / f"decode_kernels-{_build_key(compiler)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        # 512-bit vectors where the compiler vectorizes (the exp loop): it may prefer 256 otherwise
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU, or None (said once in the log) where they cannot be had."""
    compiler = _compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        log.info("native small-row kernels off: no C compiler or not x86-64; torch's kernels serve")
        return None
    try:
        lib = ctypes.CDLL(str(build(cache_dir(), compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native small-row kernels off: building them failed (%s); torch's kernels serve", detail)
        return None
    lib.cs_kernels.restype = ctypes.c_int
    for symbol in _SYMBOLS.values():
        if hasattr(lib, symbol):
            fn = getattr(lib, symbol)
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            fn.restype = None
    for symbol in _ATTEND_SYMBOLS.values():
        if hasattr(lib, symbol):
            fn = getattr(lib, symbol)
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
            fn.restype = None
    for symbol in _LAYERS_SYMBOLS.values():
        if hasattr(lib, symbol):
            fn = getattr(lib, symbol)
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
            fn.restype = None
    return lib


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
    num_out = packed.shape[0] * PANEL
    num_in = packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
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


def kv_layouts(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], num_keys: Sequence[int],
               layer_strides: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """The C side's descriptor [num_seqs, 10] int64 of each sequence's layer-0 keys and values
    [capacity, Hkv, D] (any token and head strides, unit stride within a head), its number of keys
    and its (key, value) layer strides in elements (None: one layer). Every tensor must stay alive
    (and in place) while the descriptor is used."""
    rows = []
    for j, (k, v, n) in enumerate(zip(keys, values, num_keys, strict=True)):
        k_layer, v_layer = (0, 0) if layer_strides is None else layer_strides[j]
        if (k.stride(2) != 1 or v.stride(2) != 1 or k.shape != v.shape or k.dtype != v.dtype
                or k.device.type != "cpu" or not 0 < n <= k.shape[0]):
            # the kernel reads raw memory: a wrong shape or stride would read past the tensors, not raise
            raise ValueError(f"native attention: keys {tuple(k.shape)} {tuple(k.stride())} and values "
                             f"{tuple(v.shape)} {tuple(v.stride())} with {n} keys do not fit the kernel")
        rows.append([k.data_ptr(), v.data_ptr(), n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     k_layer, v_layer, 0])
    return torch.tensor(rows, dtype=torch.int64)  # [num_seqs, NUM_LAYOUT_FIELDS]


def decode_attention(q: torch.Tensor, num_kv_heads: int, layouts: torch.Tensor, layer: int = 0,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's rotated queries q [num_seqs, H, D] over its keys and values in layer `layer`
    (`kv_layouts`, whose tensors must be of q's dtype) -> softmax(q k^T / sqrt(D)) v as
    [num_seqs, H * D]. Given k_new and v_new [num_seqs, Hkv, D], each is first written as its
    sequence's last key and value (row num_keys - 1)."""
    num_seqs, num_heads, head_dim = q.shape
    new_shape = (num_seqs, num_kv_heads, head_dim)
    if (num_heads % num_kv_heads or layouts.shape != (num_seqs, NUM_LAYOUT_FIELDS)
            or not supports_attention(q.dtype, head_dim)
            or (k_new is None) != (v_new is None)
            or (k_new is not None and not (k_new.shape == v_new.shape == new_shape
                                           and k_new.dtype == v_new.dtype == q.dtype))):
        raise ValueError(f"native attention: q {tuple(q.shape)} ({q.dtype}) over {num_kv_heads} KV heads and "
                         f"{tuple(layouts.shape)} layouts does not fit the kernel")
    q = q.contiguous()
    k_new, v_new = (None, None) if k_new is None else (k_new.contiguous(), v_new.contiguous())
    out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype)  # [num_seqs, H * D]
    kernel = getattr(library(), _ATTEND_SYMBOLS[q.dtype])
    kernel(q.data_ptr(), None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
           out.data_ptr(), layouts.data_ptr(), num_seqs, layer, num_kv_heads, num_heads // num_kv_heads, head_dim,
           head_dim ** -0.5, torch.get_num_threads())
    return out


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row's rotated queries q [H, D] over keys, values [T, Hkv, D] (any token and head strides,
    unit stride within a head) -> softmax(q k^T / sqrt(D)) v as [H * D]."""
    if keys.dtype != q.dtype or keys.ndim != 3 or keys.shape[2] != q.shape[-1]:
        raise ValueError(f"native attention: q {tuple(q.shape)} ({q.dtype}) over keys {tuple(keys.shape)} "
                         f"({keys.dtype}) does not fit the kernel")
    layouts = kv_layouts([keys], [values], [keys.shape[0]])
    return decode_attention(q[None], keys.shape[1], layouts)[0]


def supports_layers(dtype: torch.dtype) -> bool:
    """Whether `decode_layers` runs natively for this dtype."""
    lib = library()
    return lib is not None and hasattr(lib, _LAYERS_SYMBOLS.get(dtype, ""))


def layer_table(layers: Sequence[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The C side's per-layer weight addresses [num_layers, 7] int64 from, per layer, the packed
    qkv, o, gate|up and down weights (`pack`), the qkv bias (or None) and the input and
    post-attention norm weights. The tensors must stay alive while the table is used."""
    return torch.tensor([[0 if t is None else t.data_ptr() for t in layer] for layer in layers], dtype=torch.int64)


def decode_layers(h: torch.Tensor, table: torch.Tensor, layouts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float) -> torch.Tensor:
    """Every layer of one decode step (csrc/decode_layers.c): the residual stream h [num_seqs, hidden]
    of each sequence, updated in place and returned, each sequence's new K/V written into its cache
    (`kv_layouts`, whose rows num_keys - 1 are the new ones). cos, sin [num_seqs, head_dim] are the
    sequences' rotary tables in h's dtype; the weights (`layer_table`) are h's dtype too."""
    num_seqs, hidden = h.shape
    if (not h.is_contiguous() or not supports_layers(h.dtype) or table.shape[1:] != (NUM_WEIGHT_FIELDS,)
            or layouts.shape != (num_seqs, NUM_LAYOUT_FIELDS) or cos.shape != (num_seqs, head_dim)
            or sin.shape != cos.shape or cos.dtype != h.dtype or sin.dtype != h.dtype
            or not (cos.is_contiguous() and sin.is_contiguous()) or num_heads % num_kv_heads
            or not supports_attention(h.dtype, head_dim)):
        raise ValueError(f"native decode layers: h {tuple(h.shape)} ({h.dtype}), table {tuple(table.shape)}, "
                         f"layouts {tuple(layouts.shape)}, cos {tuple(cos.shape)} do not fit the kernel")
    kernel = getattr(library(), _LAYERS_SYMBOLS[h.dtype])
    kernel(h.data_ptr(), table.data_ptr(), layouts.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_seqs,
           table.shape[0], hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, torch.get_num_threads())
    return h
