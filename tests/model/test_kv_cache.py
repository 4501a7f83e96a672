"""The KV cache's two layouts (token-major for staging, head-major for decoding) and its slab pool:
the same rows through every view, moves that keep the rows, and pooled memory serving either."""
from __future__ import annotations

import pytest
import torch

from cachesmith.model.kv_cache import KVCache, SlabPool

L, HKV, D = 3, 2, 4


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)


def _filled(is_head_major: bool, capacity: int = 5, pool: SlabPool | None = None) -> KVCache:
    cache = KVCache(L, HKV, D, capacity, torch.device("cpu"), torch.float32, pool, is_head_major)
    for layer in range(L):  # the last write grows the cache past its capacity
        for start, n in ((0, 3), (3, 1), (4, 6)):
            cache.write(layer, start, *_rows(n, 10 * layer + start))
    cache.num_tokens = 10
    return cache


def _assert_same_rows(a: KVCache, b: KVCache) -> None:
    for layer in range(L):
        for x, y in zip(a.view(layer), b.view(layer)):
            assert x.shape == y.shape == (10, HKV, D) and torch.equal(x, y)
    for x, y in zip(a.rows(2, 7), b.rows(2, 7)):
        assert x.shape == (L, 5, HKV, D) and torch.equal(x, y)


def test_head_major_cache_holds_what_token_major_holds():
    token, head = _filled(False), _filled(True)
    assert token.capacity == head.capacity >= 10
    _assert_same_rows(token, head)
    _assert_same_rows(token, head.clone())
    keys = head.view(1)[0].transpose(0, 1)  # [Hkv, T, D]: each head's keys one contiguous run
    assert keys.is_contiguous() and not token.view(1)[0].transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("capacity", [None, 40])
def test_to_head_major_moves_rows_in_place_and_pools_the_old_slabs(capacity):
    pool = SlabPool()
    cache, ref = _filled(False, pool=pool), _filled(False)
    old_ptr = cache.key_slab.data_ptr()
    cache.to_head_major(capacity)
    assert cache.is_head_major and cache.capacity == (capacity or ref.capacity)
    _assert_same_rows(cache, ref)
    # the slabs of 5 rows (outgrown) and of 10 (moved from), K and V, float32
    assert pool.num_bytes == 2 * 4 * L * HKV * D * (5 + 10)
    again = KVCache(L, HKV, D, ref.capacity, torch.device("cpu"), torch.float32, pool)
    assert {again.key_slab.data_ptr(), again.value_slab.data_ptr()} >= {old_ptr}
    cache.write(0, 10, *_rows(1, 99))  # decoding writes on in the new layout
    assert torch.equal(cache.view(0, 11)[0][10], _rows(1, 99)[0][0])


def test_pooled_memory_serves_either_layout_and_only_a_fitting_one():
    pool = SlabPool()
    head = KVCache(L, HKV, D, 16, torch.device("cpu"), torch.float32, pool, is_head_major=True)
    ptr = head.key_slab.data_ptr()
    head.release()
    token = KVCache(L, HKV, D, 9, torch.device("cpu"), torch.float32, pool)  # needs 9 of 16 rows
    assert ptr in {token.key_slab.data_ptr(), token.value_slab.data_ptr()} and token.capacity == 16
    assert token.key_slab.shape == (L, 16, HKV, D) and pool.num_reused == 2
    token.release()
    small = KVCache(L, HKV, D, 7, torch.device("cpu"), torch.float32, pool)  # 16 rows > 2 x 7: fresh
    assert pool.num_reused == 2 and small.capacity == 7
    other = KVCache(L, HKV + 1, D, 16, torch.device("cpu"), torch.float32, pool)  # rows of another size
    assert pool.num_reused == 2 and other.capacity == 16


def test_pooled_key_and_value_slabs_share_one_capacity():
    """K and V slabs are taken from the pool one by one: given free slabs of different sizes, the
    value slab still matches the key slab's rows (the native kernels read both with one stride), in
    either layout, and a clone copies both."""
    for is_head_major in (False, True):
        pool = SlabPool()
        for rows in (12, 16):  # both fit 10 rows
            pool.give(torch.empty(L * rows * HKV * D))
        cache = _filled(is_head_major, capacity=10, pool=pool)
        assert cache.key_slab.shape == cache.value_slab.shape
        assert cache.key_slab.stride() == cache.value_slab.stride()
        for layers in (None, 2):
            copy = cache.clone(layers)
            for layer in range(layers or L):
                for x, y in zip(copy.view(layer), cache.view(layer)):
                    assert torch.equal(x, y)
        cache.to_head_major(40)  # a move takes a pair again
        assert cache.key_slab.stride() == cache.value_slab.stride()


@pytest.mark.sim_cuda
def test_a_pool_reuses_slabs_on_a_cuda_device_named_without_its_index(sim_cuda):
    """Slabs report `cuda:0`; a cache asked for on `cuda` must still find them (it compared
    `cuda:0 == cuda`, False, so nothing was ever reused on a GPU)."""
    pool = SlabPool()
    first = KVCache(L, HKV, D, 16, torch.device("cuda"), torch.float32, pool)
    assert first.key_slab.device == torch.device("cuda", 0)
    first.release()
    again = KVCache(L, HKV, D, 16, torch.device("cuda"), torch.float32, pool)
    assert pool.num_reused == 2 and again.key_slab.device == torch.device("cuda", 0)
    again.release()
    KVCache(L, HKV, D, 16, torch.device("cpu"), torch.float32, pool)  # never a slab of another device
    assert pool.num_reused == 2
