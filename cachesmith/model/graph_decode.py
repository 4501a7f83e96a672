"""Decode steps on CUDA as captured CUDA graphs: static buffers per (batch, length) bucket, replayed.

In: the plain-greedy sequences `Decoding` steps together (up to the largest batch bucket), each with
its `KVCache`. Out: each sequence's next token id per step (read back in one copy), each cache one
row longer, as the eager `decode_step` + `greedy_ids` give them up to floating-point rounding.

Why: a decode step launches a few hundred small kernels; on a GPU the host launching them is the
cost, not the work. A CUDA graph launches them all at once, but replays the same kernels on the
same memory, with no host value read or changed inside (gpt-fast's static cache). So a step of n
sequences runs in a bucket of B rows (the smallest of `BATCH_BUCKETS` >= n) and S key rows (a power
of two >= every sequence's cache plus the tokens it may still add, at most the model's positions):

- static slabs keys / values [L, B, Hkv, S, D]: row b of them is exactly a head-major cache's
  stores [L, Hkv, S, D], so each sequence's `KVCache` moves there once, when it joins
  (`KVCache.borrow`), and everything that reads or releases it later keeps working; it moves out
  to slabs of its own (`KVCache.own`) before its row serves another sequence;
- static inputs: each row's last token id, its position and whether it is live (padding rows sit at
  position 0 and their results are ignored);
- one step: embed -> per layer qkv, rope at the device positions, the new K/V written at (b,
  position_b) by index ops, ONE attention call over all rows with a mask built on the device (key j
  visible iff j <= position_b) -> norm, head -> argmax written into the ids; positions += live.

The step is captured once per bucket (`device.new_graph`) and replayed while the set of sequences
holds; a set that changes rewrites the static inputs from the host (one copy) and keeps the bucket
while it fits (within 2x in each dimension: a bucket too large costs padded attention, a new one a
capture and a copy of every cache). Sampled rows, rows needing the host (penalties,
log-probabilities) and more rows than the largest bucket stay on the eager path (`Decoding`): the
caches move out of the bucket, and the bucket is kept for the next greedy steps.

Memory: a bucket holds up to 2x the live KV in each dimension (B and S padding). Buckets are kept
by size within a budget (the server's `graph_bytes`, and the device's free memory); the least
recently used are freed before a new one is allocated, and a bucket that cannot fit is not captured
(its steps run eager). A capture synchronizes the device and empties torch's caches, so capturing
again costs far more than keeping a bucket.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from cachesmith.model import device as accel
from cachesmith.model.decoder import Decoder
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.sampling import Sampler, greedy_ids


class Generation(Protocol):
    """What the runner reads of a sequence (`generate.Generation`, which imports this module)."""
    cache: KVCache
    max_new_tokens: int
    sampler: Sampler
    token_ids: list[int]

log = logging.getLogger(__name__)
GIB = 1 << 30
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_LENGTH_BUCKET = 64  # key rows: shorter buckets would only be recaptured sooner


def batch_bucket(num_seqs: int) -> int | None:
    """The rows a step of `num_seqs` sequences runs in; None past the largest bucket (eager)."""
    return next((b for b in BATCH_BUCKETS if b >= num_seqs), None)


def length_bucket(num_rows: int, max_positions: int) -> int:
    """The key rows a bucket holds for caches of up to `num_rows` rows: a power of two, capped by
    the model's positions (no cache grows past them)."""
    length = MIN_LENGTH_BUCKET
    while length < num_rows:
        length *= 2
    return min(length, max_positions)


def rows_needed(gen: "Generation") -> int:
    """Cache rows `gen` holds once it has generated every token it may still add."""
    return gen.cache.num_tokens + max(0, gen.max_new_tokens - len(gen.token_ids))


class _Bucket:
    """The static buffers of one (B, S) and the step captured over them."""

    def __init__(self, model: Decoder, num_rows: int, length: int) -> None:
        cfg, device = model.config, model.device
        self.model, self.num_rows, self.length = model, num_rows, length
        shape = (cfg.num_layers, num_rows, cfg.num_kv_heads, length, cfg.head_dim)
        # zeros, not empty: a masked key's weight is 0, and 0 * NaN (garbage memory) is NaN
        self.keys = torch.zeros(shape, device=device, dtype=model.dtype)  # [L, B, Hkv, S, D]
        self.values = torch.zeros(shape, device=device, dtype=model.dtype)
        self.state = torch.zeros(3, num_rows, dtype=torch.long, device=device)  # ids, positions, live
        self.ids, self.positions, self.live = self.state.unbind(0)  # [B] each
        self.batch_index = torch.arange(num_rows, device=device)  # [B]
        self.key_positions = torch.arange(length, device=device)  # [S]
        # the graph reads these tables' memory: held here, so a later growth of the model's tables
        # (which replaces them) cannot free it under the graph
        self.cos, self.sin = model.rope.cos_sin_range(0, length)  # [S, 1, D]
        self.gens: list[Generation | None] = [None] * num_rows  # who sits in each row
        self.order: list[Generation] = []  # the sequences as last seated, in the caller's order
        self.row_of: dict[Generation, int] = {}
        # captured while every row is padding: the warm-up run writes position 0 of empty rows
        self.graph = accel.new_graph(device)
        self.graph.capture(self._step)

    def fits(self, num_rows: int, length: int) -> bool:
        return num_rows <= self.num_rows <= 2 * num_rows and length <= self.length <= 2 * length

    @torch.inference_mode()
    def _step(self) -> None:
        """One decode step over the static buffers (what the graph holds): reads ids, positions and
        the slabs, writes the slabs, the next ids and the positions. No host value goes in or out."""
        m, cfg = self.model, self.model.config
        positions = self.positions
        cos, sin = self.cos[positions], self.sin[positions]  # [B, 1, D]
        hidden = self.key_positions[None, :] > positions[:, None]  # [B, S]: keys past each row's position
        mask = torch.zeros(self.num_rows, 1, 1, self.length, dtype=m.dtype, device=m.device)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))  # [B, 1, 1, S] additive
        h = m.embed(self.ids)  # [B, hidden]
        group = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(m.layers):
            q, k, v = layer.qkv(layer.input_norm(h))  # [B, H | Hkv, D]
            q, k = m.rope.apply(q, cos, sin), m.rope.apply(k, cos, sin)
            keys, values = self.keys[i], self.values[i]  # [B, Hkv, S, D]
            where = (self.batch_index, positions)
            keys.transpose(1, 2).index_put_(where, k)  # row b, key position_b <- k[b] [Hkv, D]
            values.transpose(1, 2).index_put_(where, v)
            # the query heads sharing a KV head go in as its queries [B, Hkv, group, D]: one call
            # with a mask and no enable_gqa (a fused CUDA kernel: cuDNN or memory-efficient) and
            # no copy of K/V per query head
            grouped = q.reshape(self.num_rows, cfg.num_kv_heads, group, cfg.head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)  # [B, Hkv, group, D]
            h = h + layer.out_proj(out.reshape(self.num_rows, -1))
            h = layer.mlp_block(h)
        self.ids.copy_(greedy_ids(m.head(m.norm(h))))  # [B]: the next step's input, in place
        self.positions.add_(self.live)  # padding rows stay at 0: their writes stay in bounds

    def holds(self, gens: Sequence["Generation"]) -> bool:
        return self.order == list(gens)

    def seat(self, gens: Sequence["Generation"]) -> None:
        """Seat `gens`: those gone move out of their rows, newcomers into free ones (one cache copy
        each), and the static inputs are rewritten from the host (one copy)."""
        kept = set(gens)
        for row, gen in enumerate(self.gens):
            if gen is not None and gen not in kept:
                _move_out(gen)
                self.gens[row] = None
        seated = set(self.gens)
        free = [row for row, gen in enumerate(self.gens) if gen is None]
        for gen in gens:
            if gen not in seated:
                row = free.pop(0)
                gen.cache.borrow(self.keys[:, row], self.values[:, row])  # [L, Hkv, S, D] views
                self.gens[row] = gen
        self.order = list(gens)
        self.row_of = {gen: row for row, gen in enumerate(self.gens) if gen is not None}
        state = [[0] * self.num_rows for _ in range(3)]  # padding rows: id 0 at position 0, not live
        for gen, row in self.row_of.items():
            state[0][row], state[1][row], state[2][row] = gen.token_ids[-1], gen.cache.num_tokens, 1
        self.state.copy_(torch.tensor(state))  # [3, B]

    def empty(self) -> None:
        """Every sequence out of its row (into slabs of its own)."""
        for gen in self.gens:
            if gen is not None:
                _move_out(gen)
        self.gens = [None] * self.num_rows
        self.order, self.row_of = [], {}


def _move_out(gen: "Generation") -> None:
    """`gen`'s cache into slabs of its own, with room for the tokens it may still add (a sequence
    leaving the bucket may decode on eagerly); nothing if the caller released it already."""
    gen.cache.own(rows_needed(gen))


def bucket_bytes(model: Decoder, num_rows: int, length: int) -> int:
    """Device memory of one bucket's static slabs (K and V of every layer, row and key position)."""
    cfg = model.config
    element = torch.empty(0, dtype=model.dtype).element_size()
    return 2 * cfg.num_layers * num_rows * cfg.num_kv_heads * length * cfg.head_dim * element


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.2f} MiB"


class GraphDecoder:
    """Runs `Decoding`'s plain-greedy steps as replays of captured graphs (CUDA only).

    Buckets are kept by their size while they fit `max_bytes` (the server's budget for them;
    None: the device's free memory), so steps that go eager (a sampled row joined) and come back
    replay the bucket captured before. A bucket that must make room frees the least recently used
    ones first; one that cannot fit is not captured: its steps run eager (logged once)."""

    def __init__(self, model: Decoder, max_bytes: int | None = None) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._buckets: dict[tuple[int, int], _Bucket] = {}  # by (rows, length), least recently used first
        self._bucket: _Bucket | None = None  # the one whose rows hold caches now
        self._refused: set[tuple[int, int]] = set()
        self.num_captures = 0
        self.num_replays = 0

    @property
    def num_bytes(self) -> int:
        return sum(bucket_bytes(self.model, *key) for key in self._buckets)

    def takes(self, gens: Sequence["Generation"]) -> bool:
        """Whether a step of `gens` runs here: every row plain greedy, and a bucket for their count."""
        return (batch_bucket(len(gens)) is not None
                and all(gen.sampler.params.is_plain_greedy for gen in gens))

    @torch.inference_mode()
    def step(self, gens: Sequence["Generation"], read: Callable[[torch.Tensor], list[int]]) -> list[int] | None:
        """One step of `gens` (`takes` them): each one's next token id, its cache one row longer;
        None when no bucket fits the device (the caller steps eagerly). `read` brings the device ids
        to the host (the step's one copy back and one wait)."""
        bucket = self._arranged(gens)
        if bucket is None:
            return None
        bucket.graph.replay()
        self.num_replays += 1
        for gen in gens:
            gen.cache.num_tokens += 1
        ids = read(bucket.ids)  # [B] values
        return [ids[bucket.row_of[gen]] for gen in gens]

    def _arranged(self, gens: Sequence["Generation"]) -> _Bucket | None:
        """The bucket seating `gens`: the current one while it holds or fits them, else a kept one
        that fits, else a new one (captured)."""
        bucket = self._bucket
        if bucket is not None and bucket.holds(gens):
            return bucket
        num_rows = batch_bucket(len(gens))
        length = length_bucket(max(rows_needed(gen) for gen in gens), self.model.config.max_positions)
        if bucket is None or not bucket.fits(num_rows, length):
            if bucket is not None:  # every cache out first: its bucket may be freed to make room
                bucket.empty()
            bucket = self._bucket = None  # no reference left to a bucket `_fitting` may free
            bucket = self._bucket = self._fitting(num_rows, length)
            if bucket is None:
                return None
        self._buckets[(bucket.num_rows, bucket.length)] = self._buckets.pop((bucket.num_rows, bucket.length))
        bucket.seat(gens)
        return bucket

    def _fitting(self, num_rows: int, length: int) -> _Bucket | None:
        """A kept bucket that fits (num_rows, length), or a new one where memory allows."""
        kept = next((b for b in self._buckets.values() if b.fits(num_rows, length)), None)
        if kept is not None:
            return kept
        need = bucket_bytes(self.model, num_rows, length)
        while self._buckets and not self._has_room(need):
            del self._buckets[next(iter(self._buckets))]  # freed before the new one is allocated
        if not self._has_room(need):
            if (num_rows, length) not in self._refused:
                self._refused.add((num_rows, length))
                log.warning("decode graphs: a bucket of %d rows x %d positions needs %s, more than %s; "
                            "its steps run eager", num_rows, length, _size(need), self._room_text())
            return None
        bucket = _Bucket(self.model, num_rows, length)
        self._buckets[(num_rows, length)] = bucket
        self.num_captures += 1
        return bucket

    def _has_room(self, need: int) -> bool:
        if self.max_bytes is not None and self.num_bytes + need > self.max_bytes:
            return False
        free, _total = accel.memory_info(self.model.device)
        return need <= free

    def _room_text(self) -> str:
        free, _total = accel.memory_info(self.model.device)
        budget = "" if self.max_bytes is None else f"the {_size(self.max_bytes)} budget for graphs or "
        return f"{budget}the {_size(free)} free on the device"

    def release(self) -> None:
        """Every cache back in slabs of its own (eager steps follow: they read and grow the caches
        as their own); the buckets are kept for the next greedy steps."""
        if self._bucket is not None:
            self._bucket.empty()
            self._bucket = None
