"""One prefill graph bucket: its static buffers, the run it captures, and the copies around a replay.

In: a `BucketKey` (plan family and padded sizes) and, per replay, each request's `RequestLayout`.
Out: the captured run (`step`: reads only the static inputs and slabs, writes only the slabs and
static outputs) and each request's `RecomputeOutput` after the replay (`outputs`). The layout of
the bucket and why it is padded so: `recompute.graph_prefill`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from cachesmith.model import ChunkKV, Decoder, KVCache
from cachesmith.model.layers import grouped_mask
from cachesmith.model.rope import halves
from cachesmith.recompute.graph_probe import (attention_probs, fused_order, probe_input, query_scores,
                                              question_rows)
from cachesmith.recompute.run_state import RecomputeOutput
from cachesmith.recompute.sequence import RecomputeRequest, entries_of

QUERY_SIGNALS = ("qci", "qci_last", "fused")  # scored by the question rows' attention (`graph_probe`)
SCORES_ALL_ROWS = ("kv_dev", "fused")  # signals whose scores need every row's K, V at a layer
NUM_INTS = 5  # per request: prefix end, suffix start, tokens, rows selected, suffix rows


def size_class(n: int, floor: int) -> int:
    """The padded size of `n` rows: `floor` at least, else the next multiple of 1/32 of the power
    of two below it, and of `floor` (padding under 1/16 past a few thousand rows: a 16.4K-token
    request pads to 16.9K; in powers of two it would pad to 32K, doubling its full layers' work, and
    in eighths to 18.4K, a tenth of a forecast CacheBlend@15% run at 16K)."""
    if n <= floor:
        return floor
    step = max(floor, 1 << max(0, n.bit_length() - 6))
    return -(-n // step) * step


@dataclass(frozen=True)
class BucketKey:
    signal: str
    warmup: int
    probe: int
    target: str
    patch_start: int  # the first Patch layer (`RecomputeConfig.patch_start`)
    num_rows: int  # B
    length: int  # S, the trash row included
    num_selected: int  # K
    num_suffix: int  # Q

    def fits(self, need: "BucketKey") -> bool:
        """Whether a batch needing `need` runs in this bucket: the same plan family, at most twice
        the requests, and each size at least what it needs and at most a sixteenth more (or 16
        rows: more padding costs a long request more than a new capture)."""
        family = (self.signal, self.warmup, self.probe, self.target)
        if family != (need.signal, need.warmup, need.probe, need.target):
            return False
        sizes = ((self.length, need.length), (self.num_selected, need.num_selected), (self.num_suffix, need.num_suffix))
        return (need.num_rows <= self.num_rows <= 2 * need.num_rows
                and all(want <= have <= want + max(want // 16, 16) for have, want in sizes))


@dataclass(frozen=True)
class RequestLayout:
    """What the host knows of one request before the run."""
    request: RecomputeRequest
    suffix_ids: list[int]
    num_prefix: int
    num_context: int
    num_selected: int  # k_b
    selected: list[int] | None  # positions chosen on the host (`position` plans), else None

    @property
    def entries(self) -> list[ChunkKV]:
        """Prefix and chunks, in order."""
        return entries_of(self.request)

    @property
    def num_suffix(self) -> int:
        return len(self.suffix_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_context + self.num_suffix


def bucket_bytes(model: Decoder, key: BucketKey) -> int:
    """Device memory of a bucket: its slabs and its run's working set (`work_bytes`)."""
    return slab_bytes(model, key) + work_bytes(model, key)


def slab_bytes(model: Decoder, key: BucketKey) -> int:
    cfg = model.config
    element = torch.empty(0, dtype=model.dtype).element_size()
    return 2 * key.num_rows * cfg.num_layers * key.length * cfg.num_kv_heads * cfg.head_dim * element


def work_bytes(model: Decoder, key: BucketKey) -> int:
    """The most the run holds at once beside the slabs, which is what a graph's memory pool keeps
    (the caching allocator reuses a block freed during capture): every row of the run through one
    layer (hidden and its residual, normed rows, projections, attention, the MLP's halves),
    float32 scores with their masks and sort, the static inputs and outputs; a query probe's layer
    in float32 (its K and V, and the question rows' logits and probabilities over every position)."""
    cfg = model.config
    element = torch.empty(0, dtype=model.dtype).element_size()
    full = key.warmup > 0 or key.signal in SCORES_ALL_ROWS  # a run over all B x S rows
    rows = key.num_rows * (key.length if full else key.num_selected + key.num_suffix)
    per_row = 4 * cfg.hidden_size + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + 3 * cfg.intermediate_size + 2 * cfg.num_heads * cfg.head_dim
    scores = 8 * 4 * key.num_rows * key.length  # float32 scores, masks, the sort's values and indices
    inputs = 8 * key.num_rows * (key.length + 16 + key.num_selected)
    outputs = 4 * key.num_rows * (cfg.vocab_size + key.length) + 8 * key.num_rows * (key.num_selected + 1)
    tables = 2 * (key.num_rows + 1) * key.length * cfg.head_dim // 2 * element  # cos / sin, and per row
    probe = 0
    if key.signal in QUERY_SIGNALS:
        probe = 4 * key.num_rows * key.length * (2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.num_heads * key.num_suffix)
    return rows * per_row * element + scores + inputs + outputs + tables + probe


class PrefillBuffers:
    """The static buffers of one bucket and the run captured over them."""

    def __init__(self, model: Decoder, key: BucketKey) -> None:
        cfg, device = model.config, model.device
        self.model, self.key = model, key
        self.num_bytes = bucket_bytes(model, key)
        B, S, K = key.num_rows, key.length, key.num_selected
        shape = (B, cfg.num_layers, S, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: a masked key's weight is 0, and 0 * NaN (garbage memory) is NaN; made
        # outside inference mode, as the eager runner's caches are: rows lent to a run's outputs
        # (`lend`) may be written by a decoder that runs outside it
        with torch.inference_mode(False):
            self.keys = torch.zeros(shape, device=device, dtype=model.dtype)  # [B, L, S, Hkv, D]
            self.values = torch.zeros(shape, device=device, dtype=model.dtype)
        # (the cache, weakly: one dropped unreleased needs no move; the key rows lent it; its capacity)
        self.loans: list[tuple[weakref.ref, torch.Tensor, int]] = []
        self.state = torch.zeros(B * (S + NUM_INTS + K), dtype=torch.long, device=device)  # one host copy
        self.ids = self.state[:B * S].view(B, S)  # [B, S]
        ints = self.state[B * S:B * (S + NUM_INTS)].view(NUM_INTS, B)
        self.prefix_end, self.suffix_start, self.num_tokens, self.num_chosen, self.num_question = ints.unbind(0)
        self.host_selected = self.state[B * (S + NUM_INTS):].view(B, K)  # [B, K] `position` plans
        self.positions = torch.arange(S, device=device)  # [S]
        # the graph reads these tables' memory: held here, so a later growth of the model's tables
        # (which replaces them) cannot free it under the graph
        self.cos, self.sin = halves(*model.rope.cos_sin_range(0, S), cfg.head_dim // 2)  # [S, 1, D / 2]
        self.cos_rows, self.sin_rows = self.cos.repeat(B, 1, 1), self.sin.repeat(B, 1, 1)  # [B * S, 1, D / 2]
        self.logits = torch.zeros(B, cfg.vocab_size, device=device)  # [B, vocab] float32
        self.scores = torch.zeros(B, S, device=device)  # [B, S] float32 (KV deviation)
        self.selected = torch.zeros(B, K, dtype=torch.long, device=device)  # [B, K] positions, trash last
        self.entropy = torch.zeros(B, dtype=torch.float64, device=device)  # [B] (warmup >= 1)
        self.graph = None

    # -- around a replay (host) ----------------------------------------------------------------
    def load(self, layouts: list[RequestLayout]) -> None:
        """Each request's cached rows into its slab rows, and every static input in one copy (the
        caches still on the last run's rows moved out first)."""
        self.recall()
        B, S, K = self.key.num_rows, self.key.length, self.key.num_selected
        trash = S - 1
        ids, ints, chosen = [0] * (B * S), [[0] * B for _ in range(NUM_INTS)], [trash] * (B * K)
        for b, lay in enumerate(layouts):
            end = lay.num_prefix + lay.num_context
            if lay.entries:
                torch.cat([e.keys for e in lay.entries], dim=1, out=self.keys[b, :, :end])  # [L, end, Hkv, D]
                torch.cat([e.values for e in lay.entries], dim=1, out=self.values[b, :, :end])
            row = [t for e in lay.entries for t in e.token_ids] + lay.suffix_ids
            ids[b * S:b * S + len(row)] = row
            for i, value in enumerate((lay.num_prefix, end, lay.num_tokens, lay.num_selected, lay.num_suffix)):
                ints[i][b] = value
            if lay.selected is not None:
                chosen[b * K:b * K + len(lay.selected)] = lay.selected
        self.state.copy_(torch.tensor(ids + [v for row in ints for v in row] + chosen))

    def lend(self, layouts: list[RequestLayout]) -> list[KVCache]:
        """Each request's cache: its slab rows, lent (`KVCache.lent`: no copy; the trash row is not
        among them). Made outside inference mode, so a decoder outside it may write them."""
        with torch.inference_mode(False):
            caches = []
            for b, lay in enumerate(layouts):
                keys = self.keys[b, :, :self.key.length - 1]  # [L, S - 1, Hkv, D]
                caches.append(KVCache.lent(keys, self.values[b, :, :self.key.length - 1], lay.num_tokens,
                                           self.model.kv_pool))
                self.loans.append((weakref.ref(caches[-1]), keys, lay.num_tokens + lay.request.extra_capacity))
        return caches

    def recall(self) -> None:
        """Every cache still on this bucket's rows moved into slabs of its own, with the room its
        request asked for: before a replay writes the rows again, or the bucket is freed. A cache
        moved out already (decoding moves it, `prepare_cache`) or released costs nothing here."""
        for ref, keys, capacity in self.loans:
            cache = ref()
            if cache is not None and cache.is_lent(keys):
                cache.own(capacity)
        self.loans.clear()

    def outputs(self, layouts: list[RequestLayout], caches: list[KVCache]) -> list[RecomputeOutput]:
        """Each request's output: its cache (`lend`), the logits, scores and entropy copied out of
        the static buffers (the next replay reuses them), the selection read back in one copy."""
        key = self.key
        is_ranked = key.signal != "position"
        logits = self.logits.clone()
        scores = self.scores.clone() if is_ranked else None
        entropy = self.entropy.clone() if key.warmup >= 1 else None
        picked = self.selected.cpu() if is_ranked else None  # [B, K]
        out = []
        for b, (lay, cache) in enumerate(zip(layouts, caches)):
            if picked is None:
                selected = torch.tensor(lay.selected, dtype=torch.long) - lay.num_prefix
            else:
                selected = picked[b, :lay.num_selected] - lay.num_prefix
            context = slice(lay.num_prefix, lay.num_prefix + lay.num_context)
            out.append(RecomputeOutput(logits[b], cache, selected, None if scores is None else scores[b, context],
                                       None if entropy is None else entropy[b], lay.num_context, lay.num_suffix))
        return out

    # -- the captured run (device only) ------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """One run over the static buffers: no host value goes in or out."""
        m, key = self.model, self.key
        m.rope.apply_(self.keys, self.cos, self.sin)  # every layer's cached K at its position, at once
        is_context = (self.positions >= self.prefix_end[:, None]) & (self.positions < self.suffix_start[:, None])
        first_patch = key.patch_start
        h, scores = None, None
        if first_patch > 0 or key.signal in SCORES_ALL_ROWS:
            h = m.embed(self.ids.view(-1))  # [B * S, hidden]
            h, scores = self._full_layers(h, first_patch, is_context)
        scored = None if key.signal == "position" else self._rank(h, first_patch, scores, is_context)
        positions = self._patch_positions()  # [B, R]
        self._patch_layers(h, positions, first_patch, scored)

    def _full_layers(self, h: torch.Tensor, end: int, is_context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [0, end) over every row, exact; KV deviation's probe layers add their deviation
        from the cached rows (read before the fresh rows overwrite them). -> (h, scores [B, S])."""
        m, key = self.model, self.key
        B, S = key.num_rows, key.length
        cos, sin = self.cos_rows, self.sin_rows
        scores = torch.zeros(B, S, device=h.device)
        heads = (m.config.num_heads, m.config.num_kv_heads)
        for i in range(end):
            layer = m.layers[i]
            qk, v = layer.qk_v(layer.input_norm(h))  # [B * S, H + Hkv, D], [B * S, Hkv, D]
            q, k = m.rope.apply(qk, cos, sin).split(heads, dim=1)
            k, v = k.reshape(B, S, *k.shape[1:]), v.view(B, S, *v.shape[1:])  # [B, S, Hkv, D]
            keys, values = self.keys[:, i], self.values[:, i]  # [B, S, Hkv, D]
            if i >= key.warmup:  # a KV deviation probe layer
                scores += _deviation(k, v, keys, values, key.target)
            keys.copy_(k)
            values.copy_(v)
            q = q.reshape(B, S, *q.shape[1:])  # [B, S, H, D]
            if i == 0 and key.warmup >= 1:
                self._entropy(q, k, is_context)
            h = layer.mlp_block(h.add_(layer.out_proj(layer.attend_batch(q, keys, values, is_causal=True))))
        return h, scores

    def _rank(self, h: torch.Tensor | None, start: int, kv_scores: torch.Tensor | None, is_context: torch.Tensor):
        """The device-ranked plans' scores into `self.scores` and each request's first k_b rows into
        `self.selected`, sorted by position (trash last): the question's attention (QCI, FusionRAG's
        last layer), KV deviation, or both fused. -> KV deviation's (normed rows, K, V) of the first
        Patch layer, pre-RoPE, which its Patch pass reuses (else None)."""
        key = self.key
        query = self._query_scores(h, is_context) if key.signal in QUERY_SIGNALS else None
        kv, scored = self._kv_scores(h, start, kv_scores) if key.signal in SCORES_ALL_ROWS else (None, None)
        if key.signal == "fused":
            scores, order = fused_order(kv, query, is_context)
        else:
            scores = kv if query is None else query
            order = torch.sort(scores.masked_fill(~is_context, float("-inf")), dim=1, descending=True,
                               stable=True).indices  # [B, S] positions, best first
        self.scores.copy_(scores)
        rank = torch.arange(key.num_selected, device=order.device)
        chosen = torch.where(rank[None, :] < self.num_chosen[:, None], order[:, :key.num_selected], key.length - 1)
        self.selected.copy_(torch.sort(chosen, dim=1).values)
        return scored

    def _query_scores(self, h: torch.Tensor | None, is_context: torch.Tensor) -> torch.Tensor:
        """The question rows alone through the probe layers (`graph_probe`): QCI over [w, w + p),
        or FusionRAG's middle layers over the prefix and the question, then its last layer."""
        key, last = self.key, self.model.num_layers - 1
        rows, is_question = question_rows(self)
        hq = probe_input(self, h, rows)
        if key.signal == "qci":
            return query_scores(self, hq, range(key.warmup, key.warmup + key.probe), rows, is_question, is_context)[1]
        hq, _ = query_scores(self, hq, range(key.warmup, last), rows, is_question, is_context, hides_context=True)
        return query_scores(self, hq, range(last, last + 1), rows, is_question, is_context)[1]

    def _kv_scores(self, h: torch.Tensor, start: int, scores: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """KV deviation at the first Patch layer: its K, V of every row against the cached ones,
        added to the probe layers' `scores`. -> (scores [B, S], (normed rows, K, V) of that layer)."""
        m, key = self.model, self.key
        B, S = key.num_rows, key.length
        layer = m.layers[start]
        x = layer.input_norm(h)  # [B * S, hidden]
        k, v = layer.kv(x)  # [B * S, Hkv, D] pre-RoPE
        rotated = m.rope.apply(k, self.cos_rows, self.sin_rows)
        scores = scores + _deviation(rotated.view(B, S, *k.shape[1:]), v.view(B, S, *v.shape[1:]),
                                     self.keys[:, start], self.values[:, start], key.target)
        return scores, (x, k, v)

    def _patch_positions(self) -> torch.Tensor:
        """[B, K + Q] positions of each request's Patch rows: selected context rows, then suffix
        rows; padding slots at the trash row."""
        selected = self.host_selected if self.key.signal == "position" else self.selected  # on the host, or ranked here
        return torch.cat([selected, question_rows(self)[0]], dim=1)

    def _patch_layers(self, h: torch.Tensor | None, positions: torch.Tensor, start: int, scored) -> None:
        """Patch layers [start, L) over the selected and suffix rows; the logits of each request's
        last suffix row into `self.logits`."""
        m, key = self.model, self.key
        B, S = key.num_rows, key.length
        R = positions.shape[1]
        rows = (torch.arange(B, device=positions.device)[:, None] * S + positions).view(-1)  # [B * R]
        h_sel = m.embed(self.ids.view(-1)[rows]) if h is None else h[rows]  # [B * R, hidden]
        cos, sin = self.cos[positions.view(-1)], self.sin[positions.view(-1)]  # [B * R, 1, D / 2]
        group = m.config.num_heads // m.config.num_kv_heads
        mask = grouped_mask(self.positions[None, None, :] <= positions[:, :, None], group)  # [B, 1, group * R, S]
        where = (torch.arange(B, device=positions.device)[:, None].expand(B, R), positions)
        heads = (m.config.num_heads, m.config.num_kv_heads)
        for i in range(start, m.num_layers):
            layer = m.layers[i]
            if scored is not None and i == start:  # KV deviation's projections of this layer, reused
                x, k, v = scored
                q, k, v = m.rope.apply(layer.q(x[rows]), cos, sin), m.rope.apply(k[rows], cos, sin), v[rows]
            else:
                qk, v = layer.qk_v(layer.input_norm(h_sel))
                q, k = m.rope.apply(qk, cos, sin).split(heads, dim=1)
            keys, values = self.keys[:, i], self.values[:, i]  # [B, S, Hkv, D]
            keys.index_put_(where, k.reshape(B, R, *k.shape[1:]))
            values.index_put_(where, v.reshape(B, R, *v.shape[1:]))
            attn = layer.attend_grouped(q.reshape(B, R, *q.shape[1:]), keys, values, mask)
            h_sel = layer.mlp_block(h_sel.add_(layer.out_proj(attn)))
        last = torch.arange(B, device=positions.device) * R + key.num_selected + self.num_question - 1
        self.logits.copy_(m.head(m.norm(h_sel[last.clamp_min(0)])))

    def _entropy(self, q: torch.Tensor, k: torch.Tensor, is_context: torch.Tensor) -> None:
        """Layer 0's QCI entropy of each request (`signals.entropy_of` of the suffix rows' attention
        mass on the context), into `self.entropy`."""
        B, Q = self.key.num_rows, self.key.num_suffix
        rows, is_question = question_rows(self)  # [B, Q] each
        qs = q.gather(1, rows[:, :, None, None].expand(B, Q, *q.shape[2:]))  # [B, Q, H, D]
        visible = self.positions[None, None, :] <= rows[:, :, None]  # [B, Q, S]
        probs = attention_probs(qs, k, visible)  # [B, H, Q, S]
        mass = (probs * is_question[:, None, :, None]).sum(dim=(1, 2))  # [B, S]
        p = mass.double().clamp_min(0) * is_context
        total = p.sum(dim=1)
        p = p / total.clamp_min(1e-300)[:, None]
        n = (self.suffix_start - self.prefix_end).double()
        entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1) / torch.log(n.clamp_min(2))
        entropy = torch.where(total > 0, entropy, torch.ones_like(entropy))
        self.entropy.copy_(torch.where(n > 1, entropy, torch.zeros_like(entropy)))


def _deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor,
               target: str) -> torch.Tensor:
    """`signals.kv_deviation` of every row of a batch: [B, S, Hkv, D] each -> [B, S] float32."""
    score = torch.zeros(fresh_k.shape[:2], device=fresh_k.device)
    if target in ("k", "kv"):
        score += (fresh_k.float() - cached_k.float()).flatten(2).norm(dim=2)
    if target in ("v", "kv"):
        score += (fresh_v.float() - cached_v.float()).flatten(2).norm(dim=2)
    return score
