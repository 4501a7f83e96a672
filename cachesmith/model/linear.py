"""Linear maps whose weight is also prepacked for the CPU's GEMM library, for calls with few rows.

In: a weight `[out, in]` (and an optional bias) at load time; then inputs `[num_rows, in]`.
Out: `[num_rows, out]`, from oneDNN's prepacked weight when the row count is small (up to
MAX_PACKED_ROWS; float32 from 2 rows, bfloat16 from 1) on a CPU whose torch build has the kernel
(bfloat16 needs the CPU's bfloat16 instructions), else from `F.linear`.

Why: a decode step (and a recompute slice of a few rows) multiplies a handful of rows by every
weight, so its cost is reading the weights. MKL's and oneDNN's prepacked layouts read them faster
than the plain call. On one of our 2-core machines, a 1536x576 weight took, through `F.linear` /
prepacked (the mean over 90 distinct weights, so they come from memory, not from cache):
float32 8 rows 337 / 278 us, 16 rows 406 / 330 us, 1 row 167 / 198 us; bfloat16 1 row 173 / 132 us,
8 rows 177 / 121 us. On another (an AMD EPYC with AVX-512) one float32 row took 354 / 175 us. So
which kernel one float32 row goes to is measured on the model's own weights when it loads
(`tune_one_row`), not fixed. MKL's own packed sgemm was a little faster in float32 but its buffer
takes four times the weight's memory. Large row
counts, such as prefill, keep `F.linear`: its kernels are tuned there and the profile was
measured through them. The packed copy is a second copy of the weights in memory.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cachesmith.model import native

MAX_PACKED_ROWS = 32
_MIN_ROWS = {torch.float32: 2, torch.bfloat16: 1}  # fewer rows: F.linear is as fast or faster


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in the GEMM library's own layout, or None where no packed kernel applies."""
    if weight.device.type != "cpu" or weight.ndim != 2:
        return None
    if weight.dtype not in _MIN_ROWS or not torch.backends.mkldnn.is_available():
        return None
    try:
        if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (RuntimeError, AttributeError):  # a torch build without these ops: the plain path
        return None


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 is_packed: bool = True) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.packed = _pack(weight) if is_packed else None
        self._min_rows = _MIN_ROWS.get(weight.dtype, 1)
        self.native: torch.Tensor | None = None  # the weight in `model.native`'s layout, once tuned in
        self._max_native_rows = 0

    @property
    def is_one_row_packed(self) -> bool:
        return self.packed is not None and self._min_rows == 1

    @property
    def one_row_kernel(self) -> str:
        """Which kernel one row goes to: "native", "packed" (oneDNN) or "plain" (`F.linear`)."""
        if self._max_native_rows:
            return "native"
        return "packed" if self.is_one_row_packed else "plain"

    def is_native_for(self, x: torch.Tensor) -> bool:
        return x.ndim == 2 and x.shape[0] <= self._max_native_rows and x.dtype == self.weight.dtype

    def is_packed_for(self, x: torch.Tensor) -> bool:
        """Whether input x [num_rows, in] goes to the packed kernel."""
        packed = self.packed
        return (packed is not None and x.ndim == 2 and self._min_rows <= x.shape[0] <= MAX_PACKED_ROWS
                and x.dtype == packed.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_rows, in] -> [num_rows, out]."""
        if self.is_native_for(x):
            return native.matmul(x, self.native, self.bias)
        if not self.is_packed_for(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")


def _one_pass_s(linears: Sequence[Linear], rows: dict[int, torch.Tensor], is_packed: bool) -> float:
    start = time.perf_counter()
    for lin in linears:
        x = rows[lin.weight.shape[1]]
        if is_packed:
            torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [None], "")
        else:
            F.linear(x, lin.weight, lin.bias)
    return time.perf_counter() - start


@torch.inference_mode()
def tune_one_row(linears: Sequence[Linear], repeats: int = 3) -> bool:
    """Send one-row calls of `linears` to the packed kernel if, on these weights, it reads them
    clearly faster than `F.linear` (best of `repeats` passes over all of them, alternating, so both
    read from memory as a decode step does). Returns whether one-row calls go packed now; already
    packed ones (bfloat16, or tuned before) are not timed again."""
    packed = [lin for lin in linears if lin.packed is not None]
    if not packed or all(lin.is_one_row_packed for lin in packed):
        return bool(packed)
    rows = {lin.weight.shape[1]: torch.zeros(1, lin.weight.shape[1], dtype=lin.weight.dtype) for lin in packed}
    plain_s, packed_s = float("inf"), float("inf")
    for _ in range(repeats):
        plain_s = min(plain_s, _one_pass_s(packed, rows, is_packed=False))
        packed_s = min(packed_s, _one_pass_s(packed, rows, is_packed=True))
    is_faster = packed_s < 0.9 * plain_s  # a clear margin: the timing shares the machine
    if is_faster:
        send_one_row_packed(packed)
    return is_faster


def send_one_row_packed(linears: Sequence[Linear]) -> None:
    """One-row calls of `linears` go to the packed kernel (where they have one)."""
    for lin in linears:
        if lin.packed is not None:
            lin._min_rows = 1


def _native_pass_s(linears: Sequence[Linear], rows: dict[int, torch.Tensor], is_native: bool) -> float:
    start = time.perf_counter()
    for lin in linears:
        x = rows[lin.weight.shape[1]]
        if is_native:
            native.matmul(x, lin.native, lin.bias)
        else:
            lin(x)  # whichever kernel these rows go to now
    return time.perf_counter() - start


def _is_native_faster(linears: Sequence[Linear], num_rows: int, repeats: int) -> bool:
    """Best of `repeats` passes over all of `linears` with `num_rows` rows, alternating, so both
    read from memory as a decode step does; a clear margin, as the timing shares the machine."""
    rows = {lin.weight.shape[1]: torch.zeros(num_rows, lin.weight.shape[1], dtype=lin.weight.dtype) for lin in linears}
    current_s, native_s = float("inf"), float("inf")
    for _ in range(repeats):
        current_s = min(current_s, _native_pass_s(linears, rows, is_native=False))
        native_s = min(native_s, _native_pass_s(linears, rows, is_native=True))
    return native_s < 0.9 * current_s


@torch.inference_mode()
def tune_native(linears: Sequence[Linear], repeats: int = 3) -> int:
    """Send calls of few rows to the natively compiled kernel where, on these weights, it reads them
    clearly faster than the kernels those rows go to now: up to `native.MAX_NATIVE_ROWS` rows if it
    wins at one row and at `native.TUNED_ROWS`, one row if only there. Linears whose shape the kernel does not
    take keep their kernels; where the kernel is refused, its packed copies are dropped. Returns the
    most rows sent to it (0: none)."""
    for lin in linears:
        if lin.native is None:
            lin.native = native.pack(lin.weight)
    candidates = [lin for lin in linears if lin.native is not None and not lin._max_native_rows]
    if not candidates:
        return max((lin._max_native_rows for lin in linears), default=0)
    max_rows = 0
    if _is_native_faster(candidates, 1, repeats):
        max_rows = native.MAX_NATIVE_ROWS if _is_native_faster(candidates, native.TUNED_ROWS, repeats) else 1
    for lin in candidates:
        lin._max_native_rows = max_rows
        if not max_rows:
            lin.native = None
    return max_rows


def send_native(linears: Sequence[Linear], max_rows: int = native.MAX_NATIVE_ROWS) -> bool:
    """Calls of up to `max_rows` rows of `linears` go to the native kernel (where it takes their
    shape; 0: none go). Returns whether any does."""
    for lin in linears:
        if max_rows and lin.native is None:
            lin.native = native.pack(lin.weight)
        lin._max_native_rows = max_rows if lin.native is not None else 0
    return any(lin._max_native_rows for lin in linears)
