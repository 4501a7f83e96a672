"""The natively compiled decode kernels (`model.native`): built where the CPU has them, equal to
torch's maps, refusing what they cannot take, and routed to only when measured faster."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cachesmith.model import Decoder, native, native_build
from cachesmith.model import linear as linear_mod
from cachesmith.model.decode import decode_step
from cachesmith.model.linear import Linear, tune_native
from cachesmith.model.row_attention import tune_native_attention


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


HAS_F32 = native.supports(torch.float32)
HAS_BF16 = native.supports(torch.bfloat16)
DTYPES = [pytest.param(torch.float32, marks=pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")),
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not HAS_BF16, reason="no AVX512_BF16 here"))]


def test_kernels_exist_exactly_where_the_cpu_and_a_compiler_allow():
    flags = _cpu_flags()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        assert native.library() is None
        return
    assert HAS_F32 == ("avx512f" in flags)
    assert HAS_BF16 == ({"avx512f", "avx512_bf16"} <= flags)
    assert native.supports_attention(torch.float32, 64) == HAS_F32
    assert not native.supports_attention(torch.float32, 24)  # not a multiple of 16
    assert not native.supports(torch.float16)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64, rounded once to the input's dtype."""
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (128, 98), (32, 2)])
def test_matmul_equals_f_linear_at_every_row_count(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(dtype)
    packed = native.pack(weight)
    assert packed is not None and packed.shape[0] == shape[0] // native.PANEL
    for rows in (1, 2, 5, 8, 12, 13, 30):  # groups of up to 12 rows and their remainders
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        for b in (None, bias):
            out = native.matmul(x, packed, b)
            ref = _reference(x, weight, b)
            assert out.shape == (rows, shape[0]) and out.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output
            assert ((out.double() - ref.double()).abs() <= tol * (1 + ref.double().abs())).all()


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
def test_pack_and_matmul_refuse_what_the_kernel_cannot_take():
    assert native.pack(torch.randn(100, 64)) is None  # 100 outputs: not whole panels of 32
    if HAS_BF16:
        assert native.pack(torch.randn(96, 41).to(torch.bfloat16)) is None  # inputs go in pairs
    assert native.pack(torch.randn(96, 41)) is not None  # float32 takes any input size
    assert native.pack(torch.randn(96, 64).half()) is None  # no float16 kernel
    packed = native.pack(torch.randn(96, 64))
    with pytest.raises(ValueError, match=r"x \(2, 32\).*\[96, 64\]"):
        native.matmul(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="bfloat16"):
        native.matmul(torch.randn(1, 64).to(torch.bfloat16), packed)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row's grouped attention in float64: the reference."""
    num_kv_heads = keys.shape[1]
    grouped = q.double().view(1, num_kv_heads, q.shape[0] // num_kv_heads, q.shape[1])
    out = F.scaled_dot_product_attention(grouped, keys.double().transpose(0, 1)[None],
                                         values.double().transpose(0, 1)[None])
    return out.reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_keys", [1, 15, 16, 17, 300, 1030])
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 16), ((9, 3), 64), ((6, 6), 32)])
@pytest.mark.parametrize("is_head_major", [False, True])
def test_attention_equals_sdpa(dtype, num_keys, heads, head_dim, is_head_major):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(num_keys + head_dim)
    capacity = num_keys + 5  # a cache with spare rows: the views are strided
    if is_head_major:
        slab = torch.randn(2, num_kv_heads, capacity, head_dim, generator=g).to(dtype).transpose(1, 2)
    else:
        slab = torch.randn(2, capacity, num_kv_heads, head_dim, generator=g).to(dtype)
    keys, values = slab[0, :num_keys], slab[1, :num_keys]  # [T, Hkv, D]
    q = (2 * torch.randn(num_heads, head_dim, generator=g)).to(dtype)  # peaked softmax too
    out = native.attend_one(q, keys, values)
    ref = _sdpa(q, keys, values)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == (num_heads * head_dim,) and out.dtype == dtype
    assert (out.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_call_writes_and_attends_sequences_of_any_length(dtype):
    """Short sequences go whole to one thread each, long ones are split: one call, every layer."""
    g = torch.Generator().manual_seed(5)
    num_layers, num_kv_heads, head_dim, lengths = 3, 2, 32, (3, 700, 1500, 40)
    slabs = [torch.randn(2, num_layers, n + 2, num_kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
    before = [s.clone() for s in slabs]
    layouts = native.kv_layouts([s[0, 0] for s in slabs], [s[1, 0] for s in slabs], [n + 1 for n in lengths],
                                [(s.stride(1), s.stride(1)) for s in slabs], num_layers=num_layers)
    q = torch.randn(len(lengths), 6, head_dim, generator=g).to(dtype)
    k_new, v_new = torch.randn(2, len(lengths), num_kv_heads, head_dim, generator=g).to(dtype)
    out = native.decode_attention(q, num_kv_heads, layouts, 1, k_new, v_new)  # layer 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for j, (slab, n) in enumerate(zip(slabs, lengths)):
        assert torch.equal(slab[0, 1, n], k_new[j]) and torch.equal(slab[1, 1, n], v_new[j])
        slab[:, 1, n] = before[j][:, 1, n]
        assert torch.equal(slab, before[j])  # nothing else written: other rows and layers intact
        slab[0, 1, n], slab[1, 1, n] = k_new[j], v_new[j]
        ref = _sdpa(q[j], slab[0, 1, :n + 1], slab[1, 1, :n + 1])
        assert (out[j].double() - ref).abs().max().item() <= tol


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
@pytest.mark.parametrize("threads", [1, 3])
def test_attention_splits_keys_over_any_thread_count(monkeypatch, threads):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    keys, values = torch.randn(2, 2000, 3, 64, generator=g)  # 3 parts of 667 keys with 3 threads
    q = torch.randn(9, 64, generator=g)
    assert (native.attend_one(q, keys, values).double() - _sdpa(q, keys, values)).abs().max().item() <= 1e-5


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
def test_attention_refuses_inputs_it_would_misread():
    keys = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="native attention"):
        native.attend_one(torch.randn(4, 16), keys, torch.randn(10, 2, 32))  # values of another size
    with pytest.raises(ValueError, match="native attention"):
        native.attend_one(torch.randn(4, 16), torch.randn(10, 2, 32)[..., ::2], keys)  # strided head
    with pytest.raises(ValueError, match="native attention"):
        native.attend_one(torch.randn(5, 16), keys, keys)  # 5 query heads over 2 KV heads
    assert not tune_native_attention(4, 2, 24, torch.float32)  # a head size the kernel does not take


def test_no_compiler_means_torch_kernels_and_no_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        monkeypatch.setattr(native_build, "compiler", lambda: str(tmp_path / "no-such-cc"))
        assert native.library() is None and not native.supports(torch.float32)
        lin = Linear(torch.randn(96, 64))
        assert native.pack(lin.weight) is None and tune_native([lin]) == 0 and lin.one_row_kernel != "native"
        assert list(tmp_path.rglob("*.so")) == []  # nothing half-built left behind
    finally:
        native.library.cache_clear()  # later tests load the real build again


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
@pytest.mark.parametrize("native_s, is_chosen", [(0.5, True), (0.95, False)])
def test_small_rows_go_native_only_when_measured_clearly_faster(monkeypatch, native_s, is_chosen):
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lins = [Linear(weight, bias), Linear(torch.randn(100, 64, generator=g))]  # the second: no native shape
    monkeypatch.setattr(linear_mod, "_native_pass_s", lambda linears, rows, is_native: native_s if is_native else 1.0)
    assert tune_native(lins) == (native.MAX_NATIVE_ROWS if is_chosen else 0)
    assert (lins[0].one_row_kernel == "native") is is_chosen
    assert lins[1].native is None and lins[1].one_row_kernel != "native"
    assert (lins[0].native is not None) is is_chosen  # a refused kernel's copy is dropped
    calls = []
    monkeypatch.setattr(native, "matmul", lambda *a: calls.append(a[0].shape[0]) or F.linear(a[0], weight, bias))
    for rows in (1, 2, native.MAX_NATIVE_ROWS, native.MAX_NATIVE_ROWS + 1):
        lins[0](torch.randn(rows, 64, generator=g))
    assert calls == ([1, 2, native.MAX_NATIVE_ROWS] if is_chosen else [])  # up to MAX_NATIVE_ROWS rows only


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
def test_only_one_row_goes_native_where_it_wins_only_there(monkeypatch):
    lin = Linear(torch.randn(64, 32))

    def fake_pass(linears, rows, is_native):  # native: 2x faster at one row, 1.5x slower at 8
        num_rows = next(iter(rows.values())).shape[0]
        assert num_rows in (1, native.TUNED_ROWS)
        return (0.5 if num_rows == 1 else 1.5) if is_native else 1.0
    monkeypatch.setattr(linear_mod, "_native_pass_s", fake_pass)
    assert tune_native([lin]) == 1
    assert lin.is_native_for(torch.zeros(1, 32)) and not lin.is_native_for(torch.zeros(2, 32))


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 kernels here")
@pytest.mark.parametrize("is_head_major", [False, True])
def test_decode_on_native_kernels_equals_the_reference_step(tiny_model_dir, is_head_major):
    model = Decoder(tiny_model_dir[0])
    reference = Decoder(tiny_model_dir[0])  # torch's kernels: tiny models are not tuned at load
    model.use_native(native.MAX_NATIVE_ROWS, True)
    assert model.one_row_kernel == "native" and reference.one_row_kernel != "native"
    # the fused layers where the C side has the layer (no q/k norm), else the per-layer native path
    assert (model.native_layer_table is not None) is (not model.config.is_qk_norm)
    ids = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 40, 200)]
    ours = [model.prefill(i, extra_capacity=0 if len(i) == 40 else 4)[1] for i in ids]  # one must grow
    theirs = [reference.prefill(i, extra_capacity=4)[1] for i in ids]
    if is_head_major:
        for cache in ours:
            cache.to_head_major()
    tokens = [7, 11, 13]
    for _ in range(3):
        ref = torch.stack([reference.decode_step(t, c) for t, c in zip(tokens, theirs)])
        out = decode_step(model, tokens, ours)
        assert (out - ref).abs().max().item() < 1e-4
        assert [c.num_tokens for c in ours] == [c.num_tokens for c in theirs]
        tokens = ref.argmax(-1).tolist()
    for cache, other in zip(ours, theirs):  # the kernel wrote each new row where torch's path did
        assert torch.allclose(cache.key_slab[:, :cache.num_tokens], other.key_slab[:, :other.num_tokens], atol=1e-5)
        assert torch.allclose(cache.value_slab[:, :cache.num_tokens], other.value_slab[:, :other.num_tokens],
                              atol=1e-5)


@pytest.mark.skipif(not HAS_BF16, reason="no AVX512_BF16 here")
def test_fused_bfloat16_layers_round_as_torch_does(tiny_llama_dir, monkeypatch):
    """Every layer in one native call rounds where the per-op path rounds (RMSNorm, RoPE, SiLU * up,
    residual adds): against the per-layer path on the same native matmuls and attention, the logits
    and every cached row agree to within one bfloat16 rounding (here they were bit-identical)."""
    from cachesmith.model import decode as decode_mod

    model = Decoder(tiny_llama_dir[0], dtype="bfloat16")
    model.use_native(native.MAX_NATIVE_ROWS, True)
    assert decode_mod.is_fused(model, 3) and not decode_mod.is_fused(model, native.MAX_NATIVE_ROWS + 1)
    ids = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 40, 200)]
    fused = [model.prefill(i, extra_capacity=8)[1] for i in ids]
    per_layer = [model.prefill(i, extra_capacity=8)[1] for i in ids]
    tokens = [7, 11, 13]
    for _ in range(3):
        out = decode_step(model, tokens, fused)
        with monkeypatch.context() as m:
            m.setattr(decode_mod, "is_fused", lambda *a: False)
            ref = decode_step(model, tokens, per_layer)
        assert (out - ref).abs().max().item() <= 2e-2 and torch.equal(out.argmax(-1), ref.argmax(-1))
        tokens = ref.argmax(-1).tolist()
    for a, b in zip(fused, per_layer):
        ka, kb = a.key_slab[:, :a.num_tokens].float(), b.key_slab[:, :b.num_tokens].float()
        assert ((ka - kb).abs() <= 2 ** -7 * kb.abs() + 1e-6).all()
    model.use_native(0, False)  # switched off (as the benchmark's A/B does): torch's kernels again
    assert not decode_mod.is_fused(model, 1) and model.one_row_kernel != "native"
    assert not model.layers[0].qkv_proj.is_native_for(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16))
