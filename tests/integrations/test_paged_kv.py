"""The connector's writes into vLLM's paged caches (`integrations.paged_kv`), without vLLM: for every
flash backend and every physical layout vLLM can give it, rows of known K/V written at scattered
slots are read back, by the block table, from the flat buffer's offsets as that backend reads them
(`paged_layouts`); a writer with K and V swapped or block and offset transposed is caught; a CPU
cache goes to vLLM's op; a cache the connector cannot write is refused by name."""
from __future__ import annotations

import pytest
import torch

from cachesmith.integrations.connector_book import Load
from cachesmith.integrations.connector_worker import check_parallel
from cachesmith.integrations.paged_kv import (PagedCache, VllmOps, check_kv_cache_dtype, describe_writers,
                                              index_write, writer_for)
from cachesmith.integrations.prompt_kv import ConnectorParams
from tests.integrations.paged_layouts import FLASH_BACKENDS, LAYOUTS, Pool

NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_DIM, NUM_ROWS = 2, 24, 3, 16, 8, 37
BLOCK_IDS = [13, 3, 9]  # scattered, out of order, each < BLOCK_SIZE (so a transposed write stays in bounds)


def load(block_ids=BLOCK_IDS, num_rows=NUM_ROWS) -> Load:
    params = ConnectorParams(0, (num_rows,))
    return Load("r", list(range(num_rows + 1)), params, "", 0.0, list(block_ids), num_rows)


def rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_ROWS, NUM_HEADS, HEAD_DIM)  # [num_rows, num_kv_heads, head_dim]
    return torch.randn(shape, generator=gen) + 3.0, torch.randn(shape, generator=gen) - 3.0


def cases():
    return [(backend, layout) for backend in FLASH_BACKENDS for layout in LAYOUTS]


def written(backend: str, layout: str, make_writer, device="cpu") -> tuple[Pool, list]:
    """Each layer's known rows written at the load's slots; (the pool, [(keys, values)] per layer)."""
    pool = Pool(layout, NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_DIM, device=device)
    slots = load().slots(BLOCK_SIZE).to(device)
    expected = []
    for cache in pool.caches(backend, NUM_HEADS):
        k, v = rows(cache.layer_index)
        make_writer(cache)(k.to(device), v.to(device), slots)
        expected.append((k, v))
    return pool, expected


def found(pool: Pool, expected, block_table=BLOCK_IDS) -> bool:
    """Does the backend's read of the sequence find exactly the rows written, and nothing else?"""
    for layer, (k, v) in enumerate(expected):
        keys, values = pool.read(layer, block_table, NUM_ROWS)
        if not (torch.equal(keys, k) and torch.equal(values, v)):
            return False
    # nothing beside them: every written element is nonzero, every other one still zero
    return int(torch.count_nonzero(pool.flat)) == 2 * NUM_LAYERS * NUM_ROWS * NUM_HEADS * HEAD_DIM


@pytest.mark.parametrize(("backend", "layout"), cases())
def test_each_backend_reads_back_the_rows_written_at_scattered_slots(backend, layout, device):
    pool, expected = written(backend, layout, lambda c: writer_for(c, VllmOps())[1], device)
    assert found(pool, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_blocks_smaller_than_the_schedulers_hold_the_same_slots(layout):
    # vLLM may split a 32-token scheduler block into two 16-token kernel blocks, 2b and 2b + 1
    kernel_table = [2 * b + i for b in [5, 1] for i in (0, 1)]
    pool = Pool(layout, NUM_LAYERS, 2 * NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_DIM)
    slots = load([5, 1]).slots(2 * BLOCK_SIZE)
    for cache in pool.caches("FLASH_ATTN", NUM_HEADS):
        index_write(cache)(*rows(cache.layer_index), slots)
    assert found(pool, [rows(i) for i in range(NUM_LAYERS)], kernel_table)


def swapped(cache: PagedCache):
    write = index_write(cache)
    return lambda k, v, slots: write(v, k, slots)


def transposed(cache: PagedCache):
    key_view, value_view = cache.views()

    def write(k, v, slots):
        blocks, offsets = slots // cache.block_size, slots % cache.block_size
        key_view[offsets, blocks], value_view[offsets, blocks] = k, v
    return write


@pytest.mark.parametrize("broken", [swapped, transposed])
@pytest.mark.parametrize(("backend", "layout"), [("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "BHLNC"),
                                                 ("TRITON_ATTN", "LBHNC"), ("FLASH_ATTN", "BLHNC")])
def test_a_writer_with_k_and_v_swapped_or_block_and_offset_transposed_is_caught(backend, layout, broken):
    pool, expected = written(backend, layout, broken)
    assert not found(pool, expected)


def test_caches_the_connector_cannot_write_are_refused_by_name():
    view = Pool("LBHNC", 1, 4, NUM_HEADS, BLOCK_SIZE, HEAD_DIM).views()[0]
    with pytest.raises(ValueError, match="layer 0: attention backend FLEX_ATTENTION: the connector writes "
                                         "FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN caches only"):
        writer_for(PagedCache(0, "FLEX_ATTENTION", view, NUM_HEADS, HEAD_DIM), VllmOps())
    with pytest.raises(ValueError, match=r"layer 3: cache of shape \(4, 3, 16, 16\), expected \[num_blocks, 2, "):
        writer_for(PagedCache(3, "FLASH_ATTN", view, 2, HEAD_DIM), VllmOps())
    fp8 = torch.zeros(4, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cache dtype torch.uint8 is quantized"):
        writer_for(PagedCache(0, "FLASH_ATTN", fp8, NUM_HEADS, HEAD_DIM), VllmOps())
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'.*--kv-cache-dtype auto"):
        check_kv_cache_dtype("fp8_e4m3")
    check_kv_cache_dtype("auto")


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (4, 2)])
def test_parallel_sizes_above_one_are_refused_by_name(tp, pp):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}: the connector "
                                         "supports tensor_parallel_size=1 and pipeline_parallel_size=1 only"):
        check_parallel(tp, pp)
    check_parallel(1, 1)


def test_vllms_op_is_used_where_the_build_has_one():
    calls = []
    ops = VllmOps(cpu_attn_reshape_and_cache=lambda *args: calls.append(args))
    cpu = Pool("LBHNC", 1, 4, NUM_HEADS, BLOCK_SIZE, HEAD_DIM).caches("CPU_ATTN", NUM_HEADS)[0]
    name, write = writer_for(cpu, ops)
    write(*rows(0), load().slots(BLOCK_SIZE))
    assert name == "cpu_attn_reshape_and_cache" and len(calls) == 1 and calls[0][-1] == "vec"
    with pytest.raises(ValueError, match="a CPU_ATTN cache is written by vLLM's cpu_attn_reshape_and_cache only"):
        writer_for(cpu, VllmOps())
    # a flash cache on the CPU: vLLM's flash op is a CUDA kernel, so the index write runs
    flash = Pool("LBHNC", 1, 4, NUM_HEADS, BLOCK_SIZE, HEAD_DIM).caches("FLASH_ATTN", NUM_HEADS)[0]
    assert writer_for(flash, VllmOps(reshape_and_cache_flash=print))[0] == "index write by slot"
    assert describe_writers({0: "a", 1: "a", 2: "b", 4: "b"}, dict.fromkeys(range(5), "FLASH_ATTN")) == (
        "layers 0-1: a (FLASH_ATTN); layer 2: b (FLASH_ATTN); layer 4: b (FLASH_ATTN)")
