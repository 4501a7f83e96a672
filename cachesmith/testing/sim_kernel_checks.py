"""torch's checks of whether a fused CUDA attention kernel takes a call, each named as in torch
and written beside the source it comes from (`sim_kernels` applies them in torch's order).

In: the call's parameters (`SdpParams`: q, k, v, mask, flags, the GPU's compute capability, the
runtime cuDNN and the torch release). Out: per check, None when it passes, else torch's message.
"""
from __future__ import annotations

import math as _math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpParams:  # sdp_utils_cpp.h: struct sdp_params
    q: Any
    k: Any
    v: Any
    mask: Any
    dropout: float
    is_causal: bool
    enable_gqa: bool
    sm: tuple[int, int]
    cudnn: int | None  # versionRuntimeCuDNN(): major * 10000 + minor * 100 + patch
    torch_version: tuple[int, int]



Check = Callable[[SdpParams], "str | None"]  # a message when the check fails


# -- the checks, named as in torch ---------------------------------------------------------------

def _runtime_disabled(name: str, is_enabled: bool) -> Check:
    # sdp_utils_cpp.h: check_runtime_disabled_flash / check_runtime_disabled_mem_efficient;
    # sdp_utils.cpp: check_runtime_disabled_cudnn (the switches of at::globalContext())
    def check(p: SdpParams) -> str | None:
        return None if is_enabled else "has been runtime disabled"
    check.__name__ = name
    return check


def check_tensor_shapes(p: SdpParams) -> str | None:
    # sdp_utils_cpp.h: check_tensor_shapes: query_dim == key.dim() == value.dim() == 4
    dims = (len(p.q.shape), len(p.k.shape), len(p.v.shape))
    if dims != (4, 4, 4):
        return f"all fused kernels require 4-D query, key and value, got {dims}"
    return None


def check_for_attn_mask(p: SdpParams) -> str | None:
    # sdp_utils_cpp.h: check_for_attn_mask: "Flash Attention does not support non-null attn_mask."
    return None if p.mask is None else "Flash Attention does not support non-null attn_mask"


def check_head_dim_size_flash(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_head_dim_size_flash: q, k, v last dims equal and <= 256 (no divisibility:
    # attention.cpp pads the head dim to a multiple of 8 for flash)
    d_q, d_k, d_v = p.q.shape[-1], p.k.shape[-1], p.v.shape[-1]
    if not (d_q == d_k == d_v and d_q <= 256):
        return f"q, k, v need one last dim <= 256, got {d_q}, {d_k}, {d_v}"
    return None


def check_flash_attention_hardware_support(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_flash_attention_hardware_support: check_sm_version<sm80, sm121>
    return None if (8, 0) <= p.sm <= (12, 1) else f"flash supports sm80 - sm121, not sm{p.sm[0]}.{p.sm[1]}"


def check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(p: SdpParams) -> str | None:
    # sdp_utils.cpp: same name: no training on sm86-89 or sm120-121 with head_dim in (192, 224],
    # or in (224, 256] with dropout
    if not _input_requires_grad(p) or not ((8, 6) <= p.sm <= (8, 9) or (12, 0) <= p.sm <= (12, 1)):
        return None
    head_dim = p.q.shape[-1]
    if head_dim <= 192 or (p.dropout == 0.0 and head_dim > 224):
        return None
    return f"no flash backward with head_dim {head_dim} on sm{p.sm[0]}{p.sm[1]}"


def check_flash_causal_non_square_seqlens(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_flash_causal_non_square_seqlens: is_causal needs seqlen_q == seqlen_k
    if p.is_causal and p.q.shape[-2] != p.k.shape[-2]:
        return f"is_causal with seqlen_q {p.q.shape[-2]} != seqlen_k {p.k.shape[-2]}"
    return None


def check_dtypes_flash_attention(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_dtypes_flash_attention: FA3 (off by default) adds float8_e4m3fn on sm90+
    if p.sm[0] >= 9 and _fa3_enabled():
        return _check_tensor_dtype(p, (torch.float8_e4m3fn, *_HALF))
    return check_dtypes_low_precision(p)


def check_dtypes_low_precision(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_dtypes_low_precision: {half, bfloat16} on sm80+, {half} before
    return _check_tensor_dtype(p, _HALF if p.sm[0] >= 8 else (torch.float16,))


def check_dtypes_mem_efficient(p: SdpParams) -> str | None:
    # sdp_utils.cpp: can_use_mem_efficient_attention: check_tensor_dtype with
    # greater_than_or_equal_sm80_mem_efficient_dtypes {half, float, bfloat16}, else {half, float}
    if p.sm[0] >= 8:
        return _check_tensor_dtype(p, (torch.float16, torch.float32, torch.bfloat16))
    return _check_tensor_dtype(p, (torch.float16, torch.float32))


def _check_tensor_dtype(p: SdpParams, allowed: tuple) -> str | None:
    # sdp_utils_cpp.h: check_tensor_dtype: q, k, v of one dtype, and that dtype allowed
    if p.q.dtype == p.k.dtype == p.v.dtype and p.q.dtype in allowed:
        return None
    return f"q, k, v must all be one of {[str(d) for d in allowed]}, got {p.q.dtype}, {p.k.dtype}, {p.v.dtype}"


check_dtypes_mem_efficient.__torch_name__ = "check_tensor_dtype"


def _minimum_gemm_alignment(p: SdpParams) -> int:
    # sdp_utils.cpp: minimum_gemm_alignment (with use_tensor_cores): elements per 128 bits with
    # tensor cores (sm80+: always; sm70+: half only), at least 4 on sm80+, else 1
    is_half = p.q.dtype in _HALF
    use_tc = p.sm[0] >= 8 or (p.sm[0] >= 7 and is_half)
    alignment = 4 if p.sm[0] >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if use_tc else alignment


def check_mem_efficient_hardware_support(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_mem_efficient_hardware_support: check_sm_version<sm50, sm121>
    if (5, 0) <= p.sm <= (12, 1):
        return None
    return f"mem-efficient supports sm50 - sm121, not sm{p.sm[0]}.{p.sm[1]}"


def check_head_dim_size_mem_efficient(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_head_dim_size_mem_efficient: q, k last dims equal, q and v last dims
    # positive multiples of minimum_gemm_alignment (sm80+: 8 for half/bfloat16, 4 for float); no upper bound
    alignment = _minimum_gemm_alignment(p)
    d_q, d_k, d_v = p.q.shape[-1], p.k.shape[-1], p.v.shape[-1]
    if d_q == d_k and d_q > 0 and d_q % alignment == 0 and d_v > 0 and d_v % alignment == 0:
        return None
    return f"last dims must be divisible by {alignment} (q, k equal), got {d_q}, {d_k}, {d_v}"


def check_data_ptr_alignment_mem_efficient(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_data_ptr_alignment_mem_efficient: on sm80+, storage_offset * element_size
    # of q, k, v (not the mask) a multiple of minimum_gemm_alignment * query.element_size() (16 bytes);
    # the allocator's base pointers are 256-byte aligned; empty tensors pass
    if p.sm[0] < 8:
        return None
    alignment_bytes = _minimum_gemm_alignment(p) * p.q.element_size()
    for name, t in (("query", p.q), ("key", p.k), ("value", p.v)):
        offset_bytes = t.storage_offset() * t.element_size()
        if _numel(t) != 0 and offset_bytes % alignment_bytes != 0:
            return f"{name} storage offset {offset_bytes} bytes is not a multiple of {alignment_bytes}"
    return None


def check_cudnn_hardware_support(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_cudnn_hardware_support: check_sm_version<sm80, sm121>
    return None if (8, 0) <= p.sm <= (12, 1) else f"cuDNN MHA supports sm80 - sm121, not sm{p.sm[0]}.{p.sm[1]}"


def check_cudnn_deterministic(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_cudnn_deterministic: deterministic algorithms on (and not warn-only)
    if (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled()):
        return "cuDNN SDPA is not deterministic"
    return None


def check_cudnn_dropout(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_cudnn_dropout: dropout a multiple of 1/16
    if p.dropout * 16.0 != _math.floor(p.dropout * 16.0):
        return "cuDNN dropout probability resolution is limited to 1/16"
    return None


def check_attn_mask_shape(p: SdpParams) -> str | None:
    # sdp_utils_cpp.h: check_attn_mask_shape: no grad; 2-D (Tq|1, Tk|1) or 4-D (B|1, Hq|1, Tq|1, Tk|1)
    mask = p.mask
    if mask is None:
        return None
    if getattr(mask, "requires_grad", False):
        return "a mask that requires grad"
    shape = tuple(mask.shape)
    batch, heads, s_q, s_k = p.q.shape[0], p.q.shape[1], p.q.shape[2], p.k.shape[2]
    if len(shape) >= 2 and shape[-2] in (s_q, 1) and shape[-1] in (s_k, 1):
        if len(shape) == 2 or (len(shape) == 4 and shape[0] in (batch, 1) and shape[1] in (heads, 1)):
            return None
    return f"mask shape {shape}: use 2-D (Tq|1, Tk|1) or 4-D (B|1, H|1, Tq|1, Tk|1)"


def check_cudnn_tensor_shapes(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_cudnn_tensor_shapes
    batch, heads = p.q.shape[0], p.q.shape[1]
    s_q, s_k, d_qk, d_v = p.q.shape[2], p.k.shape[2], p.q.shape[3], p.v.shape[3]
    if batch > 65535 or heads > 65535:  # max_cudnn_dim_size
        return f"batch {batch} or heads {heads} over 65535"
    major, minor = p.sm
    is_sm90_or_sm10x = (major == 9 and minor == 0) or major == 10
    is_unsupported_sm107 = (major, minor) == (10, 7) and p.cudnn <= 92500
    head_dim_limit = 128
    # head_dim_limit = 256 on sm90/sm10x with cudnn_version > 92200 && kCuDNNFrontendSupportsD256
    # (cudnn-frontend >= 1.24 at build time: assumed here)
    if is_sm90_or_sm10x and not is_unsupported_sm107 and p.cudnn > 92200:
        head_dim_limit = 256
    elif is_sm90_or_sm10x and p.cudnn >= 91100 and d_qk == 192 and d_v == 128:  # DeepSeek dims
        head_dim_limit = 192
    if d_qk > head_dim_limit or d_v > head_dim_limit:
        return f"head_dim should be no more than {head_dim_limit}, got {d_qk}, {d_v}"
    if d_qk % 8 or d_v % 8:
        return f"head_dim should be a multiple of 8, got {d_qk}, {d_v}"
    if s_k == 1:
        return "cudnn SDPA does not support key/value sequence length 1"
    if p.dropout != 0.0 and s_q == 1:
        return "cudnn SDPA does not support query sequence length 1 with dropout"
    return None


def check_cudnn_d256_bprop_head_dim(p: SdpParams) -> str | None:
    # sdp_utils.cpp: check_cudnn_d256_bprop_head_dim: with grad, where d256 is on, backward takes only
    # (<=128, <=128), (192, 128) or (256, 256)
    if not _input_requires_grad(p):
        return None
    major, minor = p.sm
    is_sm90_or_sm10x = (major == 9 and minor == 0) or major == 10
    is_unsupported_sm107 = (major, minor) == (10, 7) and p.cudnn <= 92500
    if not (p.cudnn > 92200 and is_sm90_or_sm10x and not is_unsupported_sm107):
        return None
    d_qk, d_v = p.q.shape[3], p.v.shape[3]
    if (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256)):
        return None
    return f"no cuDNN SDPA backward with d_qk {d_qk}, d_v {d_v}"


def check_nonzero_sequence_lengths_dense(p: SdpParams) -> str | None:
    # sdp_utils_cpp.h: check_nonzero_sequence_lengths_dense
    if p.q.shape[-2] == 0 or p.k.shape[-2] == 0:
        return "all fused kernels do not support zero seq_len_q or seq_len_kv"
    return None


def _last_dim_stride_equals_1(ignore_singleton_dim: bool) -> Check:
    def check_last_dim_stride_equals_1_dense(p: SdpParams) -> str | None:
        # sdp_utils_cpp.h: check_last_dim_stride_equals_1_dense: q, k, v stride(-1) == 1 (or head_dim
        # 1 when ignore_singleton_dim), and on CUDA the mask's stride(-1) == 1 too (a broadcast
        # mask, stride 0, fails)
        strides = (p.q.stride()[-1], p.k.stride()[-1], p.v.stride()[-1])
        qkv_ok = strides == (1, 1, 1) or (ignore_singleton_dim and p.q.shape[-1] == 1)
        mask_stride = None if p.mask is None else p.mask.stride()[-1]
        if qkv_ok and mask_stride in (None, 1):
            return None
        return f"last dims need stride 1: q, k, v {strides}, mask {mask_stride}"
    return check_last_dim_stride_equals_1_dense


def _batch_size_and_num_heads(supports_gqa: bool, requires_same_num_heads: bool) -> Check:
    def check_batch_size_and_num_heads_dense(p: SdpParams) -> str | None:
        # sdp_utils_cpp.h: check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>
        if not (p.q.shape[0] == p.k.shape[0] == p.v.shape[0]):
            return "query, key and value need the same batch size"
        h_q, h_k, h_v = p.q.shape[-3], p.k.shape[-3], p.v.shape[-3]
        if p.enable_gqa and supports_gqa:
            # sdp_utils_cpp.h: check_grouped_query_attention<requires_same_num_heads>
            if requires_same_num_heads and h_k != h_v:
                return f"key and value need the same num_heads, got {h_k}, {h_v}"
            if h_k == 0 or h_v == 0 or h_q % h_k or (not requires_same_num_heads and h_q % h_v):
                return f"kv heads {h_k}, {h_v} must divide query heads {h_q}"
            return None
        # PR #191085 (torch 2.14): supports_mqa: one K/V head is taken without enable_gqa
        if p.torch_version >= (2, 14) and h_k == 1 and h_v == 1 and h_q > 0:
            return None
        if not (h_q == h_k == h_v):
            gqa = "" if supports_gqa else " (no enable_gqa support)"
            return f"query, key, value need the same num_heads{gqa}, got {h_q}, {h_k}, {h_v}"
        return None
    return check_batch_size_and_num_heads_dense


def _input_requires_grad(p: SdpParams) -> bool:
    # sdp_utils_cpp.h: input_requires_grad: any of q, k, v requires grad, and grad mode is on
    return any(getattr(t, "requires_grad", False) for t in (p.q, p.k, p.v)) and torch.is_grad_enabled()


def _numel(t) -> int:
    out = 1
    for size in t.shape:
        out *= int(size)
    return out


def _fa3_enabled() -> bool:
    getter = getattr(torch._C, "_get_fa3_sdp_enabled", None)
    return bool(getter()) if getter is not None else False
