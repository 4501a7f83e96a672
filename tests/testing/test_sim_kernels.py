"""Which SDPA kernel torch's CUDA build runs on an H100 (sm90) for the calls this project makes,
each expectation following from a rule of `sdp_utils.cpp` / `sdp_utils_cpp.h` (named in the case id
or comment; `cachesmith/testing/sim_kernels.py` cites the source line by line).

Two wheels differ in priority: a CUDA 13 wheel of torch 2.13 ships cuDNN 9.20, so
`check_prefer_cudnn_attention` (cuDNN > 9.15.0 on sm90) puts cuDNN first; the CUDA 12 wheels ship an
older cuDNN, and the order stays flash, efficient, math, cudnn (math accepts all, so cuDNN never runs).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel as backends

from cachesmith.testing.sim_kernels import (CUDNN, EFFICIENT, FLASH, MATH, explain, sdpa_choice,
                                            sdpa_choice_for_call, sdpa_kernel)

CU13 = {"cudnn": (9, 20, 0), "torch_version": (2, 13)}  # cuDNN tried first (> 9.15.0 on sm90)
CU12 = {"cudnn": (9, 10, 2), "torch_version": (2, 13)}  # cuDNN <= 9.15.0: flash first, cuDNN after math
MAIN = {"cudnn": (9, 10, 2), "torch_version": (2, 14)}  # PR #191085: mem-efficient takes enable_gqa
BF16, F32 = torch.bfloat16, torch.float32


def t(*shape: int, dtype=BF16, offset: int = 0) -> torch.Tensor:
    """A contiguous tensor of `shape` starting `offset` elements into its storage."""
    return torch.zeros(math.prod(shape) + offset, dtype=dtype)[offset:].view(shape)


def decode(dtype, d, batch=3, kv_heads=2, group=4, keys=16):
    """graph_decode: grouped queries [B, Hkv, group, D] over the slab [B, Hkv, S, D] with an
    additive float mask [B, 1, 1, S] in the model dtype, no enable_gqa."""
    return dict(q=t(batch, kv_heads, group, d, dtype=dtype), k=t(batch, kv_heads, keys, d, dtype=dtype),
                v=t(batch, kv_heads, keys, d, dtype=dtype), attn_mask=t(batch, 1, 1, keys, dtype=dtype))


def prefill(dtype=BF16, d=64, heads=8, kv_heads=2, tq=5, tk=9, mask="bool", gqa=True, causal=False):
    """layers.attend: q [1, H, Tq, D] over k, v [1, Hkv, Tk, D], a [Tq, Tk] mask or is_causal."""
    attn_mask = {"bool": t(tq, tk, dtype=torch.bool), "float": t(tq, tk, dtype=dtype), None: None}[mask]
    return dict(q=t(1, heads, tq, d, dtype=dtype), k=t(1, kv_heads, tk, d, dtype=dtype),
                v=t(1, kv_heads, tk, d, dtype=dtype), attn_mask=attn_mask, enable_gqa=gqa, is_causal=causal)


CASES = [
    # (a) the decode graph: a mask, no enable_gqa, Hq == Hkv
    # cudnn and flash take half types only (check_dtypes_low_precision); flash no mask; efficient takes f32
    pytest.param(decode(F32, 64), CU13, EFFICIENT, id="a-decode-f32-d64-cu13"),
    # flash: check_for_attn_mask; efficient: 128 % 4 == 0 (check_head_dim_size_mem_efficient, f32)
    pytest.param(decode(F32, 128), CU12, EFFICIENT, id="a-decode-f32-d128-cu12"),
    # cudnn first; a [B, 1, 1, S] mask passes check_attn_mask_shape; head_dim <= 128 and % 8
    pytest.param(decode(BF16, 64), CU13, CUDNN, id="a-decode-bf16-d64-cu13"),
    pytest.param(decode(BF16, 128), CU13, CUDNN, id="a-decode-bf16-d128-cu13"),
    # flash: check_for_attn_mask -> efficient (64, 128 % 8 == 0 for bfloat16)
    pytest.param(decode(BF16, 64), CU12, EFFICIENT, id="a-decode-bf16-d64-cu12"),
    pytest.param(decode(BF16, 128), CU12, EFFICIENT, id="a-decode-bf16-d128-cu12"),
    # check_cudnn_tensor_shapes: no key/value sequence length 1
    pytest.param(decode(BF16, 128, keys=1), CU13, EFFICIENT, id="a-decode-one-key-cu13"),
    # (b) masked prefill with enable_gqa (what layers.attend would pass without expanding heads)
    # cudnn: check_batch_size_and_num_heads_dense<supports_gqa=true>, a 2-D mask; the mask's dtype
    # is no selection rule (the choice sees the mask as passed)
    pytest.param(prefill(mask="bool"), CU13, CUDNN, id="b-gqa-bool-mask-cu13"),
    pytest.param(prefill(mask="float"), CU13, CUDNN, id="b-gqa-float-mask-cu13"),
    # flash: check_for_attn_mask; efficient: <supports_gqa=false> in 2.13; math comes before cudnn
    pytest.param(prefill(mask="bool"), CU12, MATH, id="b-gqa-bool-mask-cu12"),
    pytest.param(prefill(mask="float"), CU12, MATH, id="b-gqa-float-mask-cu12"),
    # torch 2.14 (PR #191085): the memory-efficient kernel takes enable_gqa
    pytest.param(prefill(mask="bool"), MAIN, EFFICIENT, id="b-gqa-bool-mask-2.14"),
    # layers.attend's repeat_interleave path: same heads, so efficient takes the mask
    pytest.param(prefill(mask="bool", gqa=False, kv_heads=8), CU12, EFFICIENT, id="b-expanded-heads-cu12"),
    # (c) unmasked causal bf16 with enable_gqa
    # cudnn first, no causal rule
    pytest.param(prefill(mask=None, tq=7, tk=7, causal=True), CU13, CUDNN, id="c-causal-gqa-cu13"),
    # flash: <supports_gqa=true>, square causal
    pytest.param(prefill(mask=None, tq=7, tk=7, causal=True), CU12, FLASH, id="c-causal-gqa-cu12"),
    # flash: check_flash_causal_non_square_seqlens; efficient: no gqa in 2.13
    pytest.param(prefill(mask=None, tq=5, tk=9, causal=True), CU12, MATH, id="c-nonsquare-gqa-cu12"),
    # efficient has no square rule
    pytest.param(prefill(mask=None, causal=True, gqa=False, kv_heads=8), CU12, EFFICIENT,
                 id="c-nonsquare-mha-cu12"),
    # flash: half types only; efficient: no gqa in 2.13 / gqa in 2.14
    pytest.param(prefill(F32, mask=None, tq=7, tk=7, causal=True), CU12, MATH, id="c-causal-gqa-f32"),
    pytest.param(prefill(F32, mask=None, tq=7, tk=7, causal=True), MAIN, EFFICIENT, id="c-causal-gqa-f32-2.14"),
    # (d) fp32 unmasked (row_attention.attend_one: [1, Hkv, group, D] over [1, Hkv, T, D])
    # cudnn, flash: half types only; efficient takes float32 on sm80+
    pytest.param(prefill(F32, mask=None, gqa=False, kv_heads=8), CU13, EFFICIENT, id="d-f32-unmasked"),
    # one K/V head without enable_gqa: heads differ in 2.13; 2.14 takes it (supports_mqa)
    pytest.param(prefill(F32, mask=None, gqa=False, heads=4, kv_heads=1), CU12, MATH, id="d-f32-mqa-2.13"),
    pytest.param(prefill(F32, mask=None, gqa=False, heads=4, kv_heads=1), MAIN, EFFICIENT, id="d-f32-mqa-2.14"),
    # (e) a head_dim not divisible by 8
    # cudnn: check_cudnn_tensor_shapes % 8; flash: mask; efficient: % 8 for bfloat16
    pytest.param(prefill(d=36, mask="bool", gqa=False, kv_heads=8), CU13, MATH, id="e-d36-bf16-mask"),
    # flash: check_head_dim_size_flash has no divisibility rule (attention.cpp pads to % 8)
    pytest.param(prefill(d=36, mask=None, gqa=False, kv_heads=8), CU13, FLASH, id="e-d36-bf16-unmasked"),
    # efficient: % 4 for float32 (minimum_gemm_alignment): 36 passes, 34 fails
    pytest.param(prefill(F32, d=36, mask="bool", gqa=False, kv_heads=8), CU12, EFFICIENT, id="e-d36-f32-mask"),
    pytest.param(prefill(F32, d=34, mask="bool", gqa=False, kv_heads=8), CU12, MATH, id="e-d34-f32-mask"),
    # flash: head_dim <= 256; efficient: no upper bound on CUDA
    pytest.param(prefill(d=264, mask=None, gqa=False, kv_heads=8), CU12, EFFICIENT, id="e-d264-bf16"),
]


@pytest.mark.parametrize("call, config, kernel", CASES)
def test_the_kernel_cuda_would_run(call, config, kernel):
    assert sdpa_kernel(**call, **config) == kernel


def misaligned(dtype, offset, mask=True):
    """q starting `offset` elements into its storage (a slice of a larger buffer)."""
    return dict(q=t(1, 4, 5, 64, dtype=dtype, offset=offset), k=t(1, 4, 9, 64, dtype=dtype),
                v=t(1, 4, 9, 64, dtype=dtype), attn_mask=t(5, 9, dtype=dtype) if mask else None)


@pytest.mark.parametrize("call, config, kernel", [
    # (f) check_data_ptr_alignment_mem_efficient: on sm80+ q, k, v need storage_offset *
    # element_size % 16 == 0 (minimum_gemm_alignment * element_size: 4 * 4 for f32, 8 * 2 for bf16)
    pytest.param(misaligned(F32, 1), CU12, MATH, id="f-f32-offset-4-bytes"),
    pytest.param(misaligned(F32, 4), CU12, EFFICIENT, id="f-f32-offset-16-bytes"),
    pytest.param(misaligned(BF16, 4), CU12, MATH, id="f-bf16-offset-8-bytes"),
    pytest.param(misaligned(BF16, 8), CU12, EFFICIENT, id="f-bf16-offset-16-bytes"),
    # cudnn's and flash's selection checks read no storage offset
    pytest.param(misaligned(BF16, 4), CU13, CUDNN, id="f-bf16-offset-8-bytes-cu13"),
    pytest.param(misaligned(BF16, 4, mask=False), CU12, FLASH, id="f-bf16-offset-unmasked"),
    # before PR #184258 (torch 2.13) no selection rule: efficient is chosen (its launch checks the pointers)
    pytest.param(misaligned(F32, 1), {"cudnn": (9, 10, 2), "torch_version": (2, 12)}, EFFICIENT,
                 id="f-f32-offset-2.12"),
])
def test_storage_offsets(call, config, kernel):
    assert sdpa_kernel(**call, **config) == kernel


@pytest.mark.parametrize("mask, dtype, config, kernel", [
    # (g) check_last_dim_stride_equals_1_dense reads the mask's stride(-1) too on CUDA: a transposed
    # mask (stride 5) and a broadcast one (stride 0) fail efficient, and cudnn as well
    pytest.param(t(9, 5, dtype=F32).t(), F32, CU12, MATH, id="g-transposed-mask-f32"),
    pytest.param(t(5, 1, dtype=F32).expand(5, 9), F32, CU12, MATH, id="g-broadcast-mask-f32"),
    pytest.param(t(9, 5, dtype=torch.bool).t(), BF16, CU13, MATH, id="g-transposed-bool-mask-bf16-cu13"),
    pytest.param(t(5, 9, dtype=F32), F32, CU12, EFFICIENT, id="g-contiguous-mask-f32"),
])
def test_mask_strides(mask, dtype, config, kernel):
    call = dict(q=t(1, 4, 5, 64, dtype=dtype), k=t(1, 4, 9, 64, dtype=dtype), v=t(1, 4, 9, 64, dtype=dtype))
    assert sdpa_kernel(**call, attn_mask=mask, **config) == kernel


def test_three_dimensional_inputs_run_math():
    """validate_sdpa_input takes >= 2-D inputs, but check_tensor_shapes wants 4-D for every fused kernel."""
    q, k = t(4, 5, 64), t(4, 9, 64)
    kernel, reasons = sdpa_choice(q, k, k, **CU13)
    assert kernel == MATH and len(reasons) == 3 and all("check_tensor_shapes" in r for r in reasons)


def test_the_reasons_name_the_check_that_rejected_each_kernel_tried_before():
    kernel, reasons = sdpa_choice(**prefill(mask="bool"), **CU12)
    assert kernel == MATH
    assert reasons[0].startswith("flash: check_for_attn_mask")
    assert reasons[1].startswith("efficient: check_batch_size_and_num_heads_dense")
    choice = explain(**decode(F32, 64), **CU13)
    assert [(r.kernel, r.check) for r in choice.rejected] == [
        (CUDNN, "check_dtypes_low_precision"), (FLASH, "check_for_attn_mask")]
    assert choice.kernel == EFFICIENT


@pytest.mark.parametrize("sm, kernel", [
    ((9, 0), CUDNN),  # H100: cuDNN > 9.15.0 preferred
    ((8, 0), EFFICIENT),  # A100: check_prefer_cudnn_attention wants major 9 or 10
    ((9, 2), EFFICIENT),  # minor not 0 or 3
    ((7, 5), EFFICIENT),  # T4 (float16): flash and cuDNN need sm80, efficient runs sm50 - sm121
])
def test_the_gpu_decides_the_priority_and_the_hardware_checks(sm, kernel):
    call = decode(BF16 if sm >= (8, 0) else torch.float16, 64)
    assert sdpa_kernel(**call, sm=sm, **CU13) == kernel


def test_the_cudnn_preference_follows_the_environment_and_the_build(monkeypatch):
    assert sdpa_kernel(**decode(BF16, 64), cudnn=(9, 15, 0), torch_version=(2, 13)) == EFFICIENT  # not > 91500
    assert sdpa_kernel(**decode(BF16, 64), cudnn=(9, 15, 1), torch_version=(2, 13)) == CUDNN
    assert sdpa_kernel(**decode(BF16, 64), cudnn=None, torch_version=(2, 13)) == EFFICIENT
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert sdpa_kernel(**decode(BF16, 64), **CU13) == EFFICIENT


def test_backend_switches_are_honoured():
    with backends([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert sdpa_kernel(**prefill(mask=None, tq=7, tk=7, gqa=False, kv_heads=8), **CU12) == EFFICIENT
    with backends([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError, match="No available kernel"):
            sdpa_kernel(**decode(BF16, 64), **CU12)
    assert sdpa_kernel(**prefill(mask=None, tq=7, tk=7, gqa=False, kv_heads=8), **CU12) == FLASH


def test_objects_with_the_tensor_metadata_are_enough():
    class Meta:
        def __init__(self, shape, dtype=BF16, offset=0):
            self.shape, self.dtype, self._offset = tuple(shape), dtype, offset

        def stride(self):
            return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

        def storage_offset(self):
            return self._offset

        def element_size(self):
            return torch.empty((), dtype=self.dtype).element_size()

    q, k, mask = Meta((2, 2, 4, 128)), Meta((2, 2, 16, 128)), Meta((2, 1, 1, 16))
    assert sdpa_kernel(q, k, k, mask, **CU12) == EFFICIENT
    assert sdpa_kernel(Meta((2, 2, 4, 128), offset=4), k, k, mask, **CU12) == MATH


def test_the_call_arguments_of_scaled_dot_product_attention_are_read():
    call = prefill(mask="bool")
    args = (call["q"], call["k"], call["v"], call["attn_mask"])
    assert sdpa_choice_for_call(args, {"enable_gqa": True}, **CU12)[0] == MATH
    assert sdpa_choice_for_call(args[:3], {"is_causal": False}, **CU12)[0] == MATH  # Hq != Hkv, no enable_gqa
    assert sdpa_choice_for_call(args[:3], {"enable_gqa": True}, **CU12)[0] == FLASH
