"""Which kernel torch's CUDA SDPA would run for a call, decided on a machine without a GPU.

In: the call's q, k, v and optional mask (real tensors, CPU or simulated, or anything with
`.shape`, `.dtype`, `.stride()`, `.storage_offset()`, `.element_size()`; nothing is computed),
its flags (`is_causal`, `enable_gqa`, `dropout_p`), the GPU's compute capability, the runtime
cuDNN version of the torch build, and the torch release. Out: one of "cudnn", "flash",
"efficient", "math" (`sdpa_kernel`), or that with, for each backend tried before it, the first
check that rejected it (`sdpa_choice`, `explain`), as torch's own debug warnings would name it.

Each rule is written beside the torch function it comes from:
- `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp` (pytorch main at commit 001f694a, read
  after PR #191085), `can_use_{cudnn,flash,mem_efficient}_attention` and `select_sdp_backend`;
- `aten/src/ATen/native/transformers/sdp_utils_cpp.h`, the copy shipped in the torch 2.13.0 wheel
  (`torch/include/...`, git cf30153c), for the shared checks;
- `aten/src/ATen/native/transformers/attention.cpp`: `scaled_dot_product_attention` asks
  `_fused_sdp_choice_stub` with the mask as passed (a bool mask is converted only after the choice).

What differs by release (`torch_version`):
- (2, 13): the memory-efficient kernel checks q/k/v storage offsets (PR #184258, merged
  2026-05-18, after the 2.12 cut of 2026-04-15). Before it that kernel was chosen and its launch
  checked the pointers instead.
- (2, 14): the memory-efficient kernel takes `enable_gqa`, and all fused kernels take one K/V head
  against many query heads without `enable_gqa` (PR #191085, 2026-07-25, after the 2.13 cut of
  2026-06-10; the 2.13 wheel's header has no `supports_mqa`). 2.13 and earlier: GQA in the
  memory-efficient kernel is math.
Rules of releases before 2.13 are not modelled apart from these two switches.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachesmith.testing.sim_kernel_checks import (
    CUDNN, EFFICIENT, FLASH, MATH,
    Check, SdpParams, _batch_size_and_num_heads, _last_dim_stride_equals_1, _runtime_disabled,
    check_attn_mask_shape, check_cudnn_d256_bprop_head_dim, check_cudnn_deterministic,
    check_cudnn_dropout, check_cudnn_hardware_support, check_cudnn_tensor_shapes,
    check_data_ptr_alignment_mem_efficient, check_dtypes_flash_attention, check_dtypes_low_precision,
    check_dtypes_mem_efficient, check_flash_attention_hardware_support,
    check_flash_causal_non_square_seqlens, check_for_attn_mask, check_head_dim_size_flash,
    check_head_dim_size_mem_efficient, check_mem_efficient_hardware_support,
    check_nonzero_sequence_lengths_dense,
    check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120, check_tensor_shapes)

_BY_ENUM = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}  # at::SDPBackend values
_DEFAULT_ORDER = (1, 2, 0, 3, 4)  # Context.h default: flash, efficient, math, cudnn, overrideable
_CUDNN_ORDER = (3, 1, 2, 0)  # sdp_utils.cpp: priority_order, when check_prefer_cudnn_attention
_WHEEL_CUDNN = (9, 20, 0)  # torch 2.13.0+cu13x requires nvidia-cudnn-cu13==9.20.0.48


@dataclass(frozen=True)
class Rejection:
    """Why one backend was not used: the torch check that failed first, and what it says."""
    kernel: str
    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.check}: {self.message}"


@dataclass
class Choice:
    """The kernel chosen, and the backends tried before it with the check that rejected each."""
    kernel: str
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [str(r) for r in self.rejected]


def sdpa_kernel(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, dropout_p=0.0, sm=(9, 0), *,
                cudnn: Sequence[int] | None = _WHEEL_CUDNN, torch_version: Sequence[int] | None = None) -> str:
    """The kernel torch's CUDA build runs for this call on a GPU of compute capability `sm`.

    `cudnn`: the runtime cuDNN (major, minor, patch); None for a build without cuDNN. The default
    is the torch 2.13 CUDA 13 wheels' pin (9.20.0), under which an H100 tries cuDNN first; the
    CUDA 12 wheels ship an older cuDNN, under which flash comes first. `torch_version`: (major,
    minor), by default the installed torch's. Backend switches (`torch.nn.attention.sdpa_kernel`,
    `torch.backends.cuda.enable_*_sdp`) are read as torch reads them."""
    return explain(q, k, v, attn_mask, is_causal, enable_gqa, dropout_p, sm, cudnn=cudnn,
                   torch_version=torch_version).kernel


def sdpa_choice(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, dropout_p=0.0, sm=(9, 0), *,
                cudnn: Sequence[int] | None = _WHEEL_CUDNN,
                torch_version: Sequence[int] | None = None) -> tuple[str, list[str]]:
    """`sdpa_kernel`'s answer and, for each backend tried before it, "kernel: check: message"."""
    choice = explain(q, k, v, attn_mask, is_causal, enable_gqa, dropout_p, sm, cudnn=cudnn,
                     torch_version=torch_version)
    return choice.kernel, choice.reasons


def sdpa_choice_for_call(args: tuple, kwargs: dict, **options) -> tuple[str, list[str]]:
    """`sdpa_choice` for the arguments of `F.scaled_dot_product_attention(query, key, value,
    attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, enable_gqa=False)`."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    call = dict(zip(names, args))
    call.update(kwargs)
    return sdpa_choice(call["query"], call["key"], call["value"], call.get("attn_mask"),
                       bool(call.get("is_causal", False)), bool(call.get("enable_gqa", False)),
                       float(call.get("dropout_p", 0.0)), **options)


def explain(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, dropout_p=0.0, sm=(9, 0), *,
            cudnn: Sequence[int] | None = _WHEEL_CUDNN, torch_version: Sequence[int] | None = None) -> Choice:
    """The choice with its rejections (`sdp_utils.cpp: select_sdp_backend`)."""
    version = tuple(torch_version) if torch_version is not None else _installed_version()
    cudnn_int = None if cudnn is None else _cudnn_int(cudnn)
    p = SdpParams(q, k, v, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa),
                (int(sm[0]), int(sm[1])), cudnn_int, (int(version[0]), int(version[1])))
    enabled = _enabled()
    # sdp_utils.cpp: select_sdp_backend: every backend switched off is an error
    if not any(enabled.values()):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found.")
    rejected: list[Rejection] = []
    for backend in _priority_order(p):  # sdp_utils.cpp: select_sdp_backend: first usable wins
        kernel = _BY_ENUM.get(backend)
        if kernel is None:  # overrideable: a CUDA build has no such kernel
            continue
        if kernel == MATH:
            if enabled[MATH]:  # sdp_utils.cpp: select_sdp_backend: case math
                return Choice(MATH, rejected)
            rejected.append(Rejection(MATH, "select_sdp_backend", "math has been runtime disabled"))
            continue
        failure = _first_failure(kernel, p, enabled[kernel])
        if failure is None:
            return Choice(kernel, rejected)
        rejected.append(failure)
    # sdp_utils.cpp: select_sdp_backend: TORCH_CHECK(!print_debug, "No available kernel. Aborting execution.")
    raise RuntimeError("No available kernel. Aborting execution. " + "; ".join(map(str, rejected)))


# -- priority ----------------------------------------------------------------------------------

def _priority_order(p: SdpParams) -> tuple[int, ...]:
    getter = getattr(torch._C, "_get_sdp_priority_order", None)  # the global context's order
    order = tuple(int(b) for b in getter()) if getter is not None else _DEFAULT_ORDER
    # sdp_utils.cpp: priority_order: once, the default order becomes cudnn, flash, efficient, math
    # when check_prefer_cudnn_attention; an order the user set (sdpa_kernel(set_priority=True)) stays
    if order == _DEFAULT_ORDER and _prefers_cudnn(p):
        return _CUDNN_ORDER
    return order


def _prefers_cudnn(p: SdpParams) -> bool:
    # sdp_utils.cpp: check_prefer_cudnn_attention: TORCH_CUDNN_SDPA_DEPRIORITIZED=1 keeps the default order
    if _env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    # sdp_utils.cpp: check_prefer_cudnn_attention: #if defined(CUDNN_VERSION) ... #else return false
    if p.cudnn is None:
        return False
    major, minor = p.sm
    # sdp_utils.cpp: check_prefer_cudnn_attention: cudnn_version > 91500 && (major == 9 || major == 10)
    # && (!minor || minor == 3)  [builds with CUDA >= 13 on main drop the minor test: same for sm 9.0]
    return p.cudnn > 91500 and major in (9, 10) and minor in (0, 3)


# -- one backend -------------------------------------------------------------------------------



def _first_failure(kernel: str, p: SdpParams, is_enabled: bool) -> Rejection | None:
    """The first failing check of `kernel`'s list, in torch's order (`can_use_*` returns there)."""
    build = _build_failure(kernel, p)
    if build is not None:
        return Rejection(kernel, *build)
    for check in _CHECKS[kernel](p, is_enabled):
        message = check(p)
        if message is not None:
            return Rejection(kernel, _check_name(check), message)
    return None


def _build_failure(kernel: str, p: SdpParams) -> tuple[str, str] | None:
    if kernel != CUDNN:
        return None  # USE_FLASH_ATTENTION and USE_MEM_EFF_ATTENTION are on in the CUDA wheels
    # sdp_utils.cpp: can_use_cudnn_attention: #if !AT_CUDNN_ENABLED(): "not compiled with cuDNN attention"
    if p.cudnn is None:
        return "can_use_cudnn_attention", "Torch was not compiled with cuDNN attention"
    # sdp_utils.cpp: can_use_cudnn_attention: CUDNN_VERSION < 90000 -> "cuDNN version too old"
    if p.cudnn < 90000:
        return "can_use_cudnn_attention", "cuDNN version too old to use cuDNN Attention (< v9.0.0)"
    # sdp_utils.cpp: can_use_cudnn_attention: dropout > 0 with 91100 < cudnn_version < 91400
    if p.dropout > 0.0 and 91100 < p.cudnn < 91400:
        return "can_use_cudnn_attention", "cuDNN 9.11 - 9.13 does not support dropout in SDPA"
    return None


def _flash_checks(p: SdpParams, is_enabled: bool) -> list[Check]:
    # sdp_utils.cpp: can_use_flash_attention: general_constraints, then dense_constraints
    # (check_all_tensors_on_device is left out: the simulated tensors are the device's)
    return [_runtime_disabled("check_runtime_disabled_flash", is_enabled),
            check_tensor_shapes,
            check_for_attn_mask,
            check_head_dim_size_flash,
            check_flash_attention_hardware_support,
            check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
            check_flash_causal_non_square_seqlens,
            check_dtypes_flash_attention,
            _batch_size_and_num_heads(supports_gqa=True, requires_same_num_heads=True),
            check_nonzero_sequence_lengths_dense,
            _last_dim_stride_equals_1(ignore_singleton_dim=True)]


def _efficient_checks(p: SdpParams, is_enabled: bool) -> list[Check]:
    # sdp_utils.cpp: can_use_mem_efficient_attention: general_constraints, dense_constraints, then dtypes
    checks: list[Check] = [_runtime_disabled("check_runtime_disabled_mem_efficient", is_enabled),
                           check_mem_efficient_hardware_support,
                           check_tensor_shapes,
                           check_head_dim_size_mem_efficient]
    if p.torch_version >= (2, 13):  # PR #184258: sdp_utils.cpp: check_data_ptr_alignment_mem_efficient
        checks.append(check_data_ptr_alignment_mem_efficient)
    # sdp_utils.cpp: can_use_mem_efficient_attention: supports_gqa = true on CUDA since PR #191085;
    # 2.13: check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention*/>
    supports_gqa = p.torch_version >= (2, 14)
    return checks + [check_nonzero_sequence_lengths_dense,
                     _last_dim_stride_equals_1(ignore_singleton_dim=False),
                     _batch_size_and_num_heads(supports_gqa=supports_gqa, requires_same_num_heads=True),
                     check_dtypes_mem_efficient]


def _cudnn_checks(p: SdpParams, is_enabled: bool) -> list[Check]:
    # sdp_utils.cpp: can_use_cudnn_attention: general_constraints, then dense_constraints
    # (check_for_nested_inputs and check_all_tensors_on_device pass for dense device tensors;
    # check_cudnn_layout, the packed/unpacked stride test, is defined there but in neither list)
    return [_runtime_disabled("check_runtime_disabled_cudnn", is_enabled),
            check_tensor_shapes,
            check_cudnn_deterministic,
            check_dtypes_low_precision,
            check_attn_mask_shape,
            check_cudnn_hardware_support,
            check_cudnn_dropout,
            check_nonzero_sequence_lengths_dense,
            _last_dim_stride_equals_1(ignore_singleton_dim=True),
            _batch_size_and_num_heads(supports_gqa=True, requires_same_num_heads=False),
            check_cudnn_tensor_shapes,
            check_cudnn_d256_bprop_head_dim]


_CHECKS = {FLASH: _flash_checks, EFFICIENT: _efficient_checks, CUDNN: _cudnn_checks}


# -- helpers -------------------------------------------------------------------------------------

def _check_name(check: Check) -> str:
    return getattr(check, "__torch_name__", None) or check.__name__


def _cudnn_int(version: Sequence[int]) -> int:
    parts = (list(version) + [0, 0])[:3]
    return parts[0] * 10000 + parts[1] * 100 + parts[2]


def _installed_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _env_true(name: str) -> bool:  # c10::utils::check_env
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "TRUE", "YES", "Y")


def _enabled() -> dict[str, bool]:
    """The backend switches of torch's global context (all on by default)."""
    backends = torch.backends.cuda
    return {FLASH: backends.flash_sdp_enabled(), EFFICIENT: backends.mem_efficient_sdp_enabled(),
            MATH: backends.math_sdp_enabled(), CUDNN: backends.cudnn_sdp_enabled()}


def kernel_flags(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **options) -> dict[str, Any]:
    """What `cachesmith.model.device.sdpa_kernels` answers on a GPU, decided here: each fused
    kernel's own check (`can_use_*`), the kernel picked and the reasons of the refusals."""
    version = options.get("torch_version") or _installed_version()
    cudnn = options.get("cudnn", _WHEEL_CUDNN)
    p = SdpParams(q, k, v, attn_mask, 0.0, bool(is_causal), bool(enable_gqa), tuple(options.get("sm", (9, 0))),
                None if cudnn is None else _cudnn_int(cudnn), (int(version[0]), int(version[1])))
    enabled = _enabled()
    failures = {name: _first_failure(name, p, enabled[name]) for name in (FLASH, EFFICIENT, CUDNN)}
    choice = explain(q, k, v, attn_mask, is_causal, enable_gqa, **options)
    return {**{name: failure is None for name, failure in failures.items()}, "picked": choice.kernel,
            "reasons": [str(f) for f in failures.values() if f is not None]}
