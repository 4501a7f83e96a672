"""A growable KV cache of one sequence, holding rotated K and V, and the pool its slabs come from.

In: K/V rows written per layer at explicit start offsets (by full prefill, by the recompute
runner's assembled cache, or straight from the store by the transfer engine). Out: views
`[:num_tokens]` per layer for attention.

K and V each live in one slab `[num_layers, capacity, Hkv, D]`, so the rows of one chunk across all
layers form a single view (`rows(a, b)`): the transfer engine stages stored chunk KV directly into
the cache that decoding will use, with no staging copy. Slabs come from a `SlabPool`: on the
machines we serve from, touching fresh pages costs far more than copying into memory that is
already mapped (1 GB: 2.2 s fresh against 0.12 s reused,
docs/adr/0017-kv-transfer-into-the-decode-cache.md), so a released cache hands its slabs to the next one.

A cache that will decode is moved to the head-major layout `[num_layers, Hkv, capacity, D]`
(`to_head_major`, once, on the decode thread): one query row then reads each head's keys as one
contiguous run, where the token-major layout interleaves the heads every D values. Measured on one
row's attention, 2 CPU threads, keys from memory: 1.6x faster at 1K keys and 1.9x at 4K (float32).
Staging keeps the token-major layout, whose chunk copies are plain block copies (a transposing copy
into head-major ran 1.4x slower); every view (`keys[i]`, `view`, `rows`) reads `[T, Hkv, D]` in
either layout.

On CUDA, decoding may lend a cache its stores (`borrow`): a row of a CUDA graph's static slab
(`model.graph_decode`), in the same head-major layout, so every reader keeps working; a prefill
graph's outputs are caches on its slab's rows (`lent`, token-major). Borrowed stores go back to no
pool; the lender moves the cache out (`own`) before writing them again.
"""
from __future__ import annotations

import threading

import torch

from cachesmith.model import device as accel

MAX_POOL_BYTES = 4 << 30  # the pool's bound where no server sized it (`server.memory_budget`)


class SlabPool:
    """Keeps released slabs for reuse, up to `max_bytes`; a slab is reused for a request needing at
    least half its rows (less would waste more memory than the page faults it saves). A slab is
    memory for `capacity` rows of (L, Hkv, D): it serves either layout."""

    def __init__(self, max_bytes: int = MAX_POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_reused = 0
        self._free: list[tuple[torch.Tensor, object]] = []  # flat, and the event of its giver's last use
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
             is_head_major: bool = False, max_capacity: int | None = None) -> torch.Tensor:
        """A slab for `shape` ([L, capacity, Hkv, D]) or larger in capacity (up to `max_capacity`,
        default twice the capacity), laid out [L, capacity', Hkv, D], or [L, Hkv, capacity', D] if
        `is_head_major`."""
        num_layers, capacity, num_kv_heads, head_dim = shape
        device = accel.normalize(device)  # `cuda` as its slabs report it, `cuda:0`: else none would match
        row = num_layers * num_kv_heads * head_dim  # elements per row of capacity
        max_capacity = 2 * capacity if max_capacity is None else max_capacity
        with self._lock:
            best = None
            for i, (flat, _) in enumerate(self._free):
                n = flat.numel()
                if (flat.dtype == dtype and flat.device == device and n % row == 0
                        and capacity * row <= n <= max_capacity * row
                        and (best is None or n < self._free[best][0].numel())):
                    best = i
            if best is None:
                flat = torch.empty(capacity * row, device=device, dtype=dtype)
            else:
                flat, done = self._free.pop(best)
                self.num_bytes -= _nbytes(flat)
                self.num_reused += 1
                # the work of the stream that gave it back may still be queued: this stream waits for it
                accel.current_stream(device).wait_event(done)
        rows = flat.numel() // row
        if is_head_major:
            return flat.view(num_layers, num_kv_heads, rows, head_dim)
        return flat.view(num_layers, rows, num_kv_heads, head_dim)

    def give(self, slab: torch.Tensor) -> None:
        """Back for reuse once the work issued on the giver's stream so far is done: the next taker's
        stream waits for that point (as torch's caching allocator orders a freed block's reuse)."""
        flat = slab.view(-1)
        done = accel.new_event(flat.device)
        done.record()
        # and if the pool drops it, the allocator reuses its memory only after this stream's work
        accel.record_stream(flat, accel.current_stream(flat.device))
        with self._lock:
            size = _nbytes(flat)
            while self._free and self.num_bytes + size > self.max_bytes:
                self.num_bytes -= _nbytes(self._free.pop(0)[0])  # oldest first
            if size <= self.max_bytes:
                self._free.append((flat, done))
                self.num_bytes += size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device, dtype: torch.dtype, pool: SlabPool | None = None,
                 is_head_major: bool = False) -> None:
        self.pool = pool
        self.is_head_major = is_head_major
        self.is_borrowed = False  # the stores are lent (`borrow`): never handed to the pool
        shape = (num_layers, max(capacity, 1), num_kv_heads, head_dim)
        self._set_stores(*self._take_pair(shape, device, dtype))
        self.num_tokens = 0  # rows valid in every layer

    def _take_pair(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value slabs of one capacity: a pooled slab may be larger than asked, and the
        native kernels read K and V with the same strides."""
        L, capacity, num_kv_heads, head_dim = shape
        if self.pool is None:
            full = (L, num_kv_heads, capacity, head_dim) if self.is_head_major else shape
            return torch.empty(full, device=device, dtype=dtype), torch.empty(full, device=device, dtype=dtype)
        key = self.pool.take(shape, device, dtype, self.is_head_major)
        rows = key.shape[2 if self.is_head_major else 1]
        value = self.pool.take((L, rows, num_kv_heads, head_dim), device, dtype, self.is_head_major, rows)
        return key, value

    def _set_stores(self, key_store: torch.Tensor, value_store: torch.Tensor) -> None:
        """The slabs as allocated, and their token-major views `key_slab` / `value_slab`
        [L, capacity, Hkv, D] and per layer `keys[i]` / `values[i]` [capacity, Hkv, D]."""
        self._stores = (key_store, value_store)
        if self.is_head_major:  # stores [L, Hkv, capacity, D]
            key_store, value_store = key_store.transpose(1, 2), value_store.transpose(1, 2)
        self.key_slab, self.value_slab = key_store, value_store
        self.keys = list(key_store.unbind(0))
        self.values = list(value_store.unbind(0))

    @property
    def capacity(self) -> int:
        return self.key_slab.shape[1]

    def _give(self, stores: tuple[torch.Tensor, ...]) -> None:
        if self.pool is not None and not self.is_borrowed:  # a lent slab is its lender's
            for store in stores:
                self.pool.give(store)

    def _relayout(self, capacity: int, is_head_major: bool, num_rows: int) -> None:
        """Move the first `num_rows` rows to new slabs of `capacity` rows in the given layout."""
        self.is_head_major = is_head_major
        L, _, num_kv_heads, head_dim = self.key_slab.shape
        stores = self._take_pair((L, capacity, num_kv_heads, head_dim), self.key_slab.device, self.key_slab.dtype)
        self._move_to(stores, num_rows, is_borrowed=False)

    def _move_to(self, stores: tuple[torch.Tensor, torch.Tensor], num_rows: int, is_borrowed: bool) -> None:
        """The first `num_rows` rows into `stores` (laid out as `is_head_major` says), whose owner
        is the pool unless `is_borrowed`; the old stores go back to the pool if they were its."""
        old, old_stores = (self.key_slab, self.value_slab), self._stores
        self._set_stores(*stores)
        self.key_slab[:, :num_rows] = old[0][:, :num_rows]
        self.value_slab[:, :num_rows] = old[1][:, :num_rows]
        self._give(old_stores)  # only after the copy: another thread may take them at once
        self.is_borrowed = is_borrowed

    def _grow(self, min_capacity: int) -> None:
        # mid-write (a pass writes layer by layer before num_tokens moves): every row may hold data
        self._relayout(max(min_capacity, 2 * self.capacity), self.is_head_major, self.capacity)

    def to_head_major(self, capacity: int | None = None) -> None:
        """Move to the head-major layout (what decoding reads fastest), in place, with room for at
        least `capacity` rows (default: the current capacity); the valid rows and views stay the same."""
        capacity = max(self.capacity if capacity is None else capacity, self.num_tokens, 1)
        if not self.is_head_major or capacity > self.capacity:
            self._relayout(capacity, True, self.num_tokens)

    def borrow(self, key_store: torch.Tensor, value_store: torch.Tensor) -> None:
        """Move the valid rows into stores lent by the caller, head-major [L, Hkv, capacity, D] (e.g.
        views of a CUDA graph's static slab): reads and writes go there from now on, and `release`
        gives them to no pool. The caller moves the cache out (`own`) before lending them again."""
        self.is_head_major = True
        self._move_to((key_store, value_store), self.num_tokens, is_borrowed=True)

    @classmethod
    def lent(cls, key_store: torch.Tensor, value_store: torch.Tensor, num_tokens: int,
             pool: SlabPool | None = None) -> "KVCache":
        """A cache whose first `num_tokens` rows are already in stores lent by the caller, token-major
        [L, capacity, Hkv, D] (a row of a prefill graph's slab): no copy. It moves out (`own`,
        `to_head_major`, growth) into slabs from `pool`; the lender moves it out (`own`) before
        writing the stores again."""
        cache = cls.__new__(cls)
        cache.pool, cache.is_head_major, cache.is_borrowed = pool, False, True
        cache._set_stores(key_store, value_store)
        cache.num_tokens = num_tokens
        return cache

    def is_lent(self, key_store: torch.Tensor) -> bool:
        """Whether the cache still reads and writes `key_store`, lent to it (`lent`, `borrow`)."""
        return self.is_borrowed and bool(self._stores) and self._stores[0] is key_store

    def own(self, capacity: int | None = None) -> None:
        """Move out of borrowed stores into slabs of the cache's own (from its pool), with room for
        `capacity` rows (default: as many as now); nothing to do if the stores are its own."""
        if self.is_borrowed and self.key_slab is not None:
            self._relayout(max(self.capacity if capacity is None else capacity, self.num_tokens, 1),
                           True, self.num_tokens)

    def reserve(self, num_rows: int) -> None:
        """Room for at least `num_rows` rows (grown as `write` grows it)."""
        if num_rows > self.capacity:
            self._grow(num_rows)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rotated k, v [num_rows, Hkv, D] at rows [start, start + num_rows) of `layer`."""
        end = start + k.shape[0]
        self.reserve(end)
        self.keys[layer][start:end] = k
        self.values[layer][start:end] = v

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [end, Hkv, D] of `layer` (default: all valid rows)."""
        end = self.num_tokens if end is None else end
        return self.keys[layer][:end], self.values[layer][:end]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, end - start, Hkv, D] of rows [start, end) in every layer (views)."""
        return self.key_slab[:, start:end], self.value_slab[:, start:end]

    def clone(self, num_layers: int | None = None) -> "KVCache":
        """A new cache of the same capacity and layout holding a copy of the first `num_layers`
        layers (default all); the other layers are left unset, as in a fresh cache."""
        L, capacity, num_kv_heads, head_dim = self.key_slab.shape
        out = KVCache(L, num_kv_heads, head_dim, capacity, self.key_slab.device, self.key_slab.dtype, self.pool,
                      self.is_head_major)
        n = L if num_layers is None else num_layers
        out.key_slab[:n, :capacity] = self.key_slab[:n]  # a pooled slab may hold more rows
        out.value_slab[:n, :capacity] = self.value_slab[:n]
        out.num_tokens = self.num_tokens
        return out

    def release(self) -> None:
        """Hand the slabs back to the pool; the cache (and every view of it) must not be used after."""
        self._give(self._stores)
        self._stores = ()
        self.key_slab = self.value_slab = None
        self.keys, self.values = [], []
        self.num_tokens = 0
