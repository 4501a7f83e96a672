"""Every argument the decode kernels (`model.native`) turn into a pointer, a length or a stride is
checked before the call: a wrong value raises ValueError naming the argument, and a kernel that
cannot allocate its scratch raises MemoryError and leaves the caches usable."""
from __future__ import annotations

import contextlib

import pytest
import torch

from cachesmith.model import Decoder, native
from cachesmith.model.decode import decode_step

pytestmark = pytest.mark.skipif(not native.supports(torch.float32), reason="no AVX-512 kernels here")
HKV, D = 2, 16


def _caches(num_layers=2, capacity=20, num_seqs=2, dtype=torch.float32):
    return [torch.randn(2, num_layers, capacity, HKV, D).to(dtype) for _ in range(num_seqs)]  # [K|V, L, T, Hkv, D]


def _layouts(slabs, num_keys=10, num_layers=2):
    return native.kv_layouts([s[0, 0] for s in slabs], [s[1, 0] for s in slabs], [num_keys] * len(slabs),
                             [(s.stride(1), s.stride(1)) for s in slabs], num_layers=num_layers)


@pytest.mark.parametrize("change, name", [
    (lambda k, v: (k.half(), v.half()), r"keys\[0\] is .*float16"),
    (lambda k, v: (k[..., None], v[..., None]), r"keys\[0\] is \(20, 2, 16, 1\)"),
    (lambda k, v: (k, v[:, :1]), r"values\[0\] is \(20, 1, 16\)"),
    (lambda k, v: (k, v.to(torch.bfloat16)), r"values\[0\] is .*bfloat16"),
    (lambda k, v: (torch.randn(20, HKV, 2 * D)[..., ::2], torch.randn(20, HKV, 2 * D)[..., ::2]),
     r"element stride is \(2, 2\)"),
])
def test_kv_layouts_name_a_cache_they_cannot_read(change, name):
    k, v = change(torch.randn(20, HKV, D), torch.randn(20, HKV, D))
    with pytest.raises(ValueError, match=name):
        native.kv_layouts([k], [v], [5])


def test_kv_layouts_refuse_caches_of_two_layouts_in_one_step():
    a, b = torch.randn(2, 20, HKV, D), torch.randn(2, 20, 3, D)
    with pytest.raises(ValueError, match=r"keys\[1\] is \[\*, 3, 16\].*keys\[0\]'s \[\*, 2, 16\]"):
        native.kv_layouts([a[0], b[0]], [a[1], b[1]], [5, 5])


@pytest.mark.parametrize("num_keys", [0, 21])
def test_kv_layouts_refuse_a_key_count_outside_the_capacity(num_keys):
    k = torch.randn(20, HKV, D)
    with pytest.raises(ValueError, match=rf"num_keys\[0\] is {num_keys}, expected 1 to the cache's capacity 20"):
        native.kv_layouts([k], [k], [num_keys])


def test_kv_layouts_refuse_layers_beyond_the_storage():
    """The descriptor claims a third layer of a two-layer slab: the kernel would read past it."""
    with pytest.raises(ValueError, match=r"(keys|values)\[0\] over 3 layers is reaching element \d+, expected within its storage of"):
        _layouts(_caches(num_layers=2), num_layers=3)
    with pytest.raises(ValueError, match=r"layer_strides is None, expected one .* for 2 layers"):
        native.kv_layouts([torch.randn(5, HKV, D)], [torch.randn(5, HKV, D)], [5], num_layers=2)
    with pytest.raises(ValueError, match=r"layer_strides is 1 entries, expected 2"):
        slabs = _caches()
        native.kv_layouts([s[0, 0] for s in slabs], [s[1, 0] for s in slabs], [5, 5], [(1, 1)], num_layers=2)
    with pytest.raises(ValueError, match=r"keys / values / num_keys is 1 / 1 / 2 entries"):
        native.kv_layouts([torch.randn(5, HKV, D)], [torch.randn(5, HKV, D)], [5, 5])


@pytest.mark.parametrize("table", [torch.zeros(1, native.NUM_LAYOUT_FIELDS),  # float
                                   torch.zeros(2, 2 * native.NUM_LAYOUT_FIELDS, dtype=torch.int64)[:, ::2],  # strided
                                   torch.zeros(1, 9, dtype=torch.int64)])
def test_a_layouts_table_must_be_contiguous_int64_of_ten_fields(table):
    with pytest.raises(ValueError, match=r"native descriptor: layouts is .*expected a contiguous int64 CPU tensor"):
        native.KVLayouts(table, torch.float32, HKV, D, 1)


def test_decode_attention_takes_only_layouts_built_by_kv_layouts():
    layouts = _layouts(_caches())
    with pytest.raises(ValueError, match=r"layouts is a Tensor, expected native.KVLayouts"):
        native.decode_attention(torch.randn(2, 4, D), HKV, layouts.table)


@pytest.mark.parametrize("q, kv_heads, layer, name", [
    (torch.randn(3, 4, D), HKV, 0, r"q is \(3, 4, 16\), expected \[2, H, 16\]"),  # a sequence too many
    (torch.randn(2, 4, 32), HKV, 0, r"q is \(2, 4, 32\), expected \[2, H, 16\]"),  # another head size
    (torch.randn(2, 4, D).to(torch.bfloat16), HKV, 0, r"q is torch.bfloat16 on cpu, expected the caches' torch.float32"),
    (torch.empty(2, 4, D, device="meta"), HKV, 0, r"q is torch.float32 on meta"),
    (torch.randn(2, 4, D), 1, 0, r"num_kv_heads is 1, expected the caches' 2"),
    (torch.randn(2, 3, D), HKV, 0, r"num_kv_heads is 2, expected .* dividing q's 3 heads"),
    (torch.randn(2, 4, D), HKV, 2, r"layer is 2, expected 0 to 1"),
    (torch.randn(2, 4, D), HKV, -1, r"layer is -1, expected 0 to 1"),
])
def test_decode_attention_names_an_argument_that_does_not_fit_its_caches(q, kv_heads, layer, name):
    layouts = _layouts(_caches())
    with pytest.raises(ValueError, match=name):
        native.decode_attention(q, kv_heads, layouts, layer)


@pytest.mark.parametrize("k_new, v_new, name", [
    (torch.randn(2, HKV, D), None, r"k_new and v_new are one given, one None"),
    (torch.randn(2, HKV, 8), torch.randn(2, HKV, 8), r"k_new is \(2, 2, 8\) .*expected \[2, 2, 16\]"),
    (torch.randn(2, HKV, D), torch.randn(2, HKV, D).double(), r"v_new is .*float64"),
    (torch.randn(2, HKV, D), torch.empty(2, HKV, D, device="meta"), r"v_new is .*on meta"),
])
def test_decode_attention_checks_the_new_rows_it_writes(k_new, v_new, name):
    layouts = _layouts(_caches())
    with pytest.raises(ValueError, match=name):
        native.decode_attention(torch.randn(2, 4, D), HKV, layouts, 0, k_new, v_new)


def test_decode_attention_refuses_a_head_size_without_a_kernel():
    k = torch.randn(10, HKV, 24)
    with pytest.raises(ValueError, match=r"head size is 24 .*expected a multiple of 16"):
        native.decode_attention(torch.randn(1, 4, 24), HKV, native.kv_layouts([k], [k], [10]))


@pytest.fixture
def tiny_native(tiny_llama_dir):
    model = Decoder(tiny_llama_dir[0])
    model.use_native(native.MAX_NATIVE_ROWS, True)
    assert model.native_layer_table is not None
    return model


def _layer_weights(model):
    return [[*(lin.native for lin in layer.linears), layer.qkv_bias, layer.input_norm.weight, layer.post_norm.weight]
            for layer in model.layers]


def _table(model, layers=None, **dims):
    cfg = model.config
    kwargs = dict(hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps) | dims
    return native.layer_table(_layer_weights(model) if layers is None else layers, **kwargs)


@pytest.mark.parametrize("edit, name", [
    (lambda w: w[0].__setitem__(1, w[0][1][:1]), r"layers\[0\].o is .*expected a contiguous packed"),
    (lambda w: w[1].__setitem__(3, w[1][3].double()), r"layers\[1\].down is .*float64"),
    (lambda w: w[0].__setitem__(0, w[0][0].transpose(0, 1)), r"layers\[0\].qkv is"),
    (lambda w: w[0].__setitem__(5, w[0][5][:-1]), r"layers\[0\].input_norm is .*expected a contiguous torch.float32 vector"),
    (lambda w: w[1].__setitem__(4, torch.zeros(3)), r"layers\[1\].qkv_bias is \(3,\)"),
    (lambda w: w[0].pop(), r"layers is \[6, 7, 7\], expected at least one layer of 7 weights"),
])
def test_layer_table_names_a_weight_of_the_wrong_shape(tiny_native, edit, name):
    weights = _layer_weights(tiny_native)
    edit(weights)
    with pytest.raises(ValueError, match=name):
        _table(tiny_native, weights)


def test_layer_table_checks_its_dims_and_its_table():
    with pytest.raises(ValueError, match=r"num_heads / num_kv_heads is \(4, 3\)"):
        native.LayerTable(torch.zeros(1, native.NUM_WEIGHT_FIELDS, dtype=torch.int64), torch.float32, 64, 4, 3, 16, 128, 1e-5)
    with pytest.raises(ValueError, match=r"native descriptor: table is \(1, 7\) torch.int32"):
        native.LayerTable(torch.zeros(1, native.NUM_WEIGHT_FIELDS, dtype=torch.int32), torch.float32, 64, 4, 2, 16, 128, 1e-5)


def _step_args(model, num_seqs=2, num_layers=None, kv_heads=None, dtype=torch.float32):
    cfg = model.config
    num_layers = cfg.num_layers if num_layers is None else num_layers
    slabs = [torch.randn(2, num_layers, 12, kv_heads or cfg.num_kv_heads, cfg.head_dim).to(dtype) for _ in range(num_seqs)]
    layouts = native.kv_layouts([s[0, 0] for s in slabs], [s[1, 0] for s in slabs], [4] * num_seqs,
                                [(s.stride(1), s.stride(1)) for s in slabs], num_layers=num_layers)
    h = torch.randn(num_seqs, cfg.hidden_size).to(dtype)
    cos, sin = torch.randn(2, num_seqs, cfg.head_dim).to(dtype)
    return h, layouts, cos, sin, slabs


def test_decode_layers_name_what_does_not_fit_the_weights(tiny_native):
    table = tiny_native.native_layer_table
    h, layouts, cos, sin, _ = _step_args(tiny_native)
    hidden, cfg = table.hidden, tiny_native.config
    cases = [
        ((h, table.table, layouts, cos, sin), r"table and layouts are a Tensor and a KVLayouts"),
        ((h[:, :-1], table, layouts, cos, sin), rf"h is \(2, {hidden - 1}\), expected contiguous \[2, {hidden}\]"),
        ((h[:1], table, layouts, cos, sin), rf"h is \(1, {hidden}\), expected contiguous \[2, {hidden}\]"),
        ((h.t().contiguous().t(), table, layouts, cos, sin), r"h is .*expected contiguous"),
        ((h.double(), table, layouts, cos, sin), r"h and the caches are torch.float64 and torch.float32"),
        ((h, table, layouts, cos[:, :-1].contiguous(), sin), rf"cos is \(2, {cfg.head_dim - 1}\)"),
        ((h, table, layouts, cos, sin.double()), r"sin is .*torch.float64"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            native.decode_layers(*args)
    few = _step_args(tiny_native, num_layers=cfg.num_layers - 1)
    with pytest.raises(ValueError, match=rf"the caches hold {cfg.num_layers - 1} layers, expected at least the weights' {cfg.num_layers}"):
        native.decode_layers(few[0], table, few[1], few[2], few[3])
    other = _step_args(tiny_native, kv_heads=cfg.num_kv_heads * 2)
    with pytest.raises(ValueError, match=r"the caches' \(KV heads, head size\) is"):
        native.decode_layers(other[0], table, other[1], other[2], other[3])


@contextlib.contextmanager
def max_alloc(num_bytes: int):
    """Every kernel allocation over `num_bytes` fails (kernel_alloc.h) inside the block."""
    native.library().cs_set_max_alloc(num_bytes)
    try:
        yield
    finally:
        native.library().cs_set_max_alloc(-1)


def _scores_bytes(num_keys: int) -> int:
    return 4 * 3 * (num_keys + 8)  # one_row_attention.c: each thread's scores of up to 3 queries


def test_attention_that_cannot_allocate_raises_memory_error_and_then_works():
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 2000, HKV, D, generator=g)
    q = torch.randn(4, D, generator=g)
    expected = native.attend_one(q, keys, values)
    with max_alloc(0), pytest.raises(MemoryError, match=r"native attention: could not allocate \d+ bytes"):
        native.attend_one(q, keys, values)
    # its small buffers fit, each thread's scores do not: the failure inside the parallel region
    with max_alloc(_scores_bytes(2000) - 1), pytest.raises(MemoryError, match=rf"allocate {_scores_bytes(2000)} bytes"):
        native.attend_one(q, keys, values)
    assert torch.equal(native.attend_one(q, keys, values), expected)


def test_a_decode_step_that_cannot_allocate_raises_and_leaves_its_caches_usable(tiny_native, tiny_llama_dir):
    """Both failures of the fused layers (its own buffer, then attention's inside a layer) raise
    MemoryError; the caches are not advanced, and the step retried equals torch's reference step."""
    reference = Decoder(tiny_llama_dir[0])
    # 250 keys: each thread's scores (3108 bytes) outgrow the step's own buffer (2944 here)
    ids = torch.randint(3, 128, (250,), generator=torch.Generator().manual_seed(3))
    ours, theirs = tiny_native.prefill(ids, extra_capacity=4)[1], reference.prefill(ids, extra_capacity=4)[1]
    for limit, name in ((0, r"native decode layers: could not allocate"),
                        (_scores_bytes(251) - 1, rf"native decode layers: could not allocate {_scores_bytes(251)} bytes")):
        with max_alloc(limit), pytest.raises(MemoryError, match=name):
            decode_step(tiny_native, [7], [ours])
        assert ours.num_tokens == 250
    out = decode_step(tiny_native, [7], [ours])
    assert (out[0] - reference.decode_step(7, theirs)).abs().max().item() < 1e-4
