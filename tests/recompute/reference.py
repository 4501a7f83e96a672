"""A slow, plainly written reference of the recompute runner's semantics, one request at a time.

In: a `Decoder` (only its pieces: `embed`, per layer `input_norm` / `qkv` / `out_proj` / `post_norm` /
`mlp`, `norm`, `head`, `rope.rotate`), one `RecomputeRequest` (cached prefix and chunks as pre-RoPE
`ChunkKV`, suffix ids, optional per-request coverage) and a `RecomputeConfig` `(S, w, p, r)`.
Out: `Reference`: last-position logits [vocab] (float32), the selected context indices (sorted),
the selection scores over context tokens [N] (float64; None for `position` and for plans that
compute every layer in full), and the final assembled rotated K / V of every layer [S, Hkv, D].

Nothing here comes from `cachesmith.recompute` except the config types. Semantics (the plan's contract,
docs/adr/0014-recompute-semantics.md), layout [prefix P | chunks (context, N) | suffix n]:
- WarmUp [0, w): every token computed exactly, nothing cached is read.
- qci: the suffix rows alone run [w, w+p) over the cached prefix + context and their own fresh
  K/V; score = softmax mass on each context token summed over layers, heads, query tokens; then
  everything rewinds to layer w.
- qci_last: the suffix rows run [w, L-1) over the cached prefix and themselves only; at L-1 they see
  prefix + context + themselves, and the mass on the context is the score; rewind to w (p unused).
- kv_dev: [w, w+p) are full layers; score = per-token L2 norm (all heads and dims) of fresh - cached
  pre-RoPE K and/or V, summed over layers w..w+p, layer w+p from the fresh projections of every
  row; Patch starts at w+p (no Patch at all when w+p = L).
- fused (w >= 1): qci_last's scores and kv_dev's at layer w (p = 0), each ranked, the rankings
  interleaved (kv_dev's k-th, then qci_last's k-th, skipping taken tokens); rewind to w.
- position: the first ceil(r*|c|) tokens of every chunk but the first.
- Selection (non-position): the top ceil(r*N) scores, ties in position order.
- Patch [start, L): selected context rows + suffix rows get Q/K/V from their hidden states, their
  fresh K/V overwrite the cached rows, they attend over the mixed K/V causally by true position.
Attention is an explicit masked softmax in float64 with K/V heads repeated for GQA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from cachesmith.model import ChunkKV, Decoder
from cachesmith.recompute.config import RecomputeConfig, Signal


@dataclass
class Layout:
    """Where each part of one request sits in the assembled prompt (positions 0..S-1)."""
    entries: list[ChunkKV]  # cached prefix (if any) then the chunks, in prompt order
    chunk_lens: list[int]
    num_prefix: int
    num_context: int
    num_suffix: int
    token_ids: torch.Tensor  # [S]

    @property
    def num_cached(self) -> int:
        return self.num_prefix + self.num_context

    @property
    def num_tokens(self) -> int:
        return self.num_cached + self.num_suffix

    @property
    def context(self) -> slice:
        return slice(self.num_prefix, self.num_cached)

    def suffix_positions(self) -> torch.Tensor:
        return torch.arange(self.num_cached, self.num_tokens)  # [n]


@dataclass
class Reference:
    logits: torch.Tensor  # [vocab] float32
    selected: list[int]  # sorted context indices recomputed in Patch
    scores: torch.Tensor | None  # [N] float64
    keys: list[torch.Tensor]  # per layer [S, Hkv, D], rotated
    values: list[torch.Tensor]  # per layer [S, Hkv, D]
    parts: tuple[torch.Tensor, ...] = ()  # fused: the kv_dev and qci_last scores it fused [N] each


def layout_of(req) -> Layout:
    entries = ([req.prefix] if req.prefix is not None else []) + list(req.chunks)
    ids = [t for e in entries for t in e.token_ids] + list(req.suffix_ids)
    return Layout(entries=entries, chunk_lens=[c.num_tokens for c in req.chunks],
                  num_prefix=req.prefix.num_tokens if req.prefix is not None else 0,
                  num_context=sum(c.num_tokens for c in req.chunks), num_suffix=len(req.suffix_ids),
                  token_ids=torch.tensor(ids))


# -- building blocks ---------------------------------------------------------------------------
def cached_kv(model: Decoder, lay: Layout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached K of prefix + chunks, each rotated to its assembled positions, and cached V.
    -> [P + N, Hkv, D] each."""
    keys, values, start = [], [], 0
    for entry in lay.entries:
        positions = torch.arange(start, start + entry.num_tokens)
        keys.append(model.rope.rotate(entry.keys[layer], positions))  # [T, Hkv, D]
        values.append(entry.values[layer])
        start += entry.num_tokens
    return torch.cat(keys), torch.cat(values)


def cached_context_pre_rope(lay: Layout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE cached K and V of the chunks only -> [N, Hkv, D] each."""
    chunks = lay.entries[1:] if lay.num_prefix else lay.entries
    return torch.cat([c.keys[layer] for c in chunks]), torch.cat([c.values[layer] for c in chunks])


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [Tq, H, D] over rotated keys / values [Tk, Hkv, D], key j visible to query i iff
    k_pos[j] <= q_pos[i]. -> output [Tq, H * D] in q's dtype, probabilities [H, Tq, Tk] float64."""
    num_q, num_heads, head_dim = q.shape
    rep = num_heads // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)  # [Tk, H, D]
    v = values.double().repeat_interleave(rep, dim=1)  # [Tk, H, D]
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(head_dim)  # [H, Tq, Tk]
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)  # [H, Tq, Tk]
    out = torch.einsum("hqk,khd->qhd", probs, v)  # [Tq, H, D]
    return out.reshape(num_q, num_heads * head_dim).to(q.dtype), probs


def project(model: Decoder, index: int, h: torch.Tensor, positions: torch.Tensor):
    """Hidden [T, hidden] at positions [T] -> rotated q [T, H, D], rotated k, pre-RoPE k, v [T, Hkv, D]."""
    layer = model.layers[index]
    q, k, v = layer.qkv(layer.input_norm(h))
    return model.rope.rotate(q, positions), model.rope.rotate(k, positions), k, v


def finish_layer(model: Decoder, index: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual attention output then residual MLP: [T, hidden] -> [T, hidden] (no in-place ops)."""
    layer = model.layers[index]
    h = h + layer.out_proj(attn)
    return h + layer.mlp(layer.post_norm(h))


def deviation(fresh_k, fresh_v, cached_k, cached_v, target: str) -> torch.Tensor:
    """Per-token L2 norm over heads and dims of fresh - cached; inputs [N, Hkv, D] -> [N] float64."""
    def l2(a, b):
        return ((a.double() - b.double()) ** 2).sum(dim=(1, 2)).sqrt()
    k_dev = l2(fresh_k, cached_k) if target in ("k", "kv") else 0.0
    v_dev = l2(fresh_v, cached_v) if target in ("v", "kv") else 0.0
    return k_dev + v_dev


# -- phases ------------------------------------------------------------------------------------
def full_layer(model: Decoder, index: int, h: torch.Tensor):
    """Every token computed exactly. -> new hidden [S, hidden], (rotated K, V) [S, Hkv, D],
    pre-RoPE (k, v) [S, Hkv, D]."""
    pos = torch.arange(h.shape[0])
    q, k_rot, k, v = project(model, index, h, pos)
    attn, _ = attention(q, k_rot, v, pos, pos)
    return finish_layer(model, index, h, attn), (k_rot, v), (k, v)


def qci_scores(model: Decoder, lay: Layout, hq: torch.Tensor, layers) -> torch.Tensor:
    """Suffix hidden [n, hidden] runs `layers` over cached prefix + context + its fresh K/V.
    -> context scores [N] float64 (the updated hidden is dropped: the rewind)."""
    scores = torch.zeros(lay.num_context, dtype=torch.float64)
    q_pos, k_pos = lay.suffix_positions(), torch.arange(lay.num_tokens)
    for index in layers:
        q, k, _, v = project(model, index, hq, q_pos)
        ck, cv = cached_kv(model, lay, index)  # [P + N, Hkv, D]
        attn, probs = attention(q, torch.cat([ck, k]), torch.cat([cv, v]), q_pos, k_pos)
        scores += probs[:, :, lay.context].sum(dim=(0, 1))
        hq = finish_layer(model, index, hq, attn)
    return scores


def qci_last_scores(model: Decoder, lay: Layout, hq: torch.Tensor, warmup: int) -> torch.Tensor:
    """Suffix hidden [n, hidden] runs [w, L-1) over the cached prefix and itself, then the last
    layer scores the context as qci does. -> [N] float64."""
    last = model.num_layers - 1
    q_pos = lay.suffix_positions()
    k_pos = torch.cat([torch.arange(lay.num_prefix), q_pos])  # [P + n]
    for index in range(warmup, last):
        q, k, _, v = project(model, index, hq, q_pos)
        ck, cv = cached_kv(model, lay, index)
        pk, pv = ck[:lay.num_prefix], cv[:lay.num_prefix]  # [P, Hkv, D]
        attn, _ = attention(q, torch.cat([pk, k]), torch.cat([pv, v]), q_pos, k_pos)
        hq = finish_layer(model, index, hq, attn)
    return qci_scores(model, lay, hq, [last])


def kv_dev_probe(model: Decoder, lay: Layout, h: torch.Tensor, config: RecomputeConfig,
                 keys: dict, values: dict):
    """Full layers [w, w+p) (their K/V stored), deviation summed over w..w+p.
    -> (hidden [S, hidden] entering layer w+p, scores [N] float64, first Patch layer w+p)."""
    scores = torch.zeros(lay.num_context, dtype=torch.float64)
    start = config.warmup + config.probe
    for index in range(config.warmup, start):
        ck, cv = cached_context_pre_rope(lay, index)
        h, (keys[index], values[index]), (k, v) = full_layer(model, index, h)
        scores += deviation(k[lay.context], v[lay.context], ck, cv, config.kv_dev_target)
    if start < model.num_layers:
        layer = model.layers[start]
        _, k, v = layer.qkv(layer.input_norm(h))  # fresh pre-RoPE k, v of every row [S, Hkv, D]
        ck, cv = cached_context_pre_rope(lay, start)
        scores += deviation(k[lay.context], v[lay.context], ck, cv, config.kv_dev_target)
    return h, scores, start


def mixed_kv(model: Decoder, lay: Layout, index: int, rows: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, overwrite_selected: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached rotated K / V of prefix + chunks, with the fresh rows k, v [R, Hkv, D] (positions
    `rows` [R]) written over them. -> [S, Hkv, D] each. `overwrite_selected=False` is a deliberate
    bug for the negative test: only suffix rows are written, selected rows keep cached K/V."""
    ck, cv = cached_kv(model, lay, index)  # [P + N, Hkv, D]
    empty = torch.full((lay.num_suffix, *ck.shape[1:]), float("nan"), dtype=ck.dtype)
    keys, values = torch.cat([ck, empty]), torch.cat([cv, empty])  # [S, Hkv, D]
    write = torch.ones_like(rows, dtype=torch.bool) if overwrite_selected else rows >= lay.num_cached
    keys[rows[write]], values[rows[write]] = k[write], v[write]
    assert not keys.isnan().any() and not values.isnan().any(), "a suffix row was never written"
    return keys, values


def patch_layer(model: Decoder, lay: Layout, index: int, h_rows: torch.Tensor, rows: torch.Tensor,
                overwrite_selected: bool = True):
    """Rows `rows` [R] (sorted positions) with hidden [R, hidden] over the mixed K/V.
    -> new hidden [R, hidden], mixed (K, V) [S, Hkv, D]."""
    q, k, _, v = project(model, index, h_rows, rows)
    keys, values = mixed_kv(model, lay, index, rows, k, v, overwrite_selected)
    attn, _ = attention(q, keys, values, rows, torch.arange(lay.num_tokens))
    return finish_layer(model, index, h_rows, attn), (keys, values)


# -- selection ---------------------------------------------------------------------------------
def coverage_count(coverage: float, n: int) -> int:
    """ceil(r * n) with r read as the decimal it was written as (0.3 * 10 is 3, not 4)."""
    return min(n, math.ceil(Fraction(str(coverage)) * n))


def ranking(scores: torch.Tensor) -> list[int]:
    """Context indices by score, best first; equal scores in position order."""
    return sorted(range(scores.numel()), key=lambda j: (-float(scores[j]), j))


def fused_ranking(kv_scores: torch.Tensor, qci_scores: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The two rankings interleaved, KV deviation's k-th token before the query's k-th, a token
    already taken skipped. -> (scores [N] float64: 1 - the first rank a token was taken at / N,
    the order)."""
    n = kv_scores.numel()
    order, taken_at = [], {}
    for k, pair in enumerate(zip(ranking(kv_scores), ranking(qci_scores))):
        for j in pair:
            if j not in taken_at:
                taken_at[j] = k
                order.append(j)
    return torch.tensor([1.0 - taken_at[j] / n for j in range(n)], dtype=torch.float64), order


def select_top(scores: torch.Tensor, coverage: float) -> list[int]:
    return sorted(ranking(scores)[:coverage_count(coverage, scores.numel())])


def select_position(lay: Layout, coverage: float) -> list[int]:
    """EPIC: the first ceil(r * |c|) tokens of every chunk but the first; all of them at r = 1."""
    if coverage >= 1.0:
        return list(range(lay.num_context))
    picks, start = [], 0
    for c, length in enumerate(lay.chunk_lens):
        if c > 0:
            picks += range(start, start + coverage_count(coverage, length))
        start += length
    return picks


def relative_cut_gap(scores: torch.Tensor, coverage: float) -> float:
    """(last kept - first dropped) / the larger magnitude: how far selection is from a near-tie."""
    count, order = coverage_count(coverage, scores.numel()), ranking(scores)
    if count in (0, scores.numel()):
        return math.inf
    kept, dropped = float(scores[order[count - 1]]), float(scores[order[count]])
    scale = max(abs(kept), abs(dropped))
    return math.inf if scale == 0.0 and kept == dropped else (kept - dropped) / scale


# -- the whole plan ----------------------------------------------------------------------------
def run_reference(model: Decoder, req, config: RecomputeConfig,
                  overwrite_selected: bool = True) -> Reference:
    """Execute `config` on `req` (coverage: the request's, else the plan's)."""
    lay = layout_of(req)
    coverage = req.coverage if req.coverage is not None else config.coverage
    num_layers, w = model.num_layers, config.warmup
    keys, values = {}, {}
    with torch.inference_mode():
        h = model.embed(lay.token_ids)  # [S, hidden]
        for index in range(min(w, num_layers)):
            h, (keys[index], values[index]), _ = full_layer(model, index, h)
        if w >= num_layers:
            return _finish(model, h, list(range(lay.num_context)), None, keys, values)
        scores, start = None, w
        hq = h[lay.suffix_positions()]  # [n, hidden] at layer w, for the query-only probes
        if config.signal is Signal.KV_DEV:
            h, scores, start = kv_dev_probe(model, lay, h, config, keys, values)
            if start == num_layers:  # every layer was a full layer
                return _finish(model, h, list(range(lay.num_context)), None, keys, values)
        elif config.signal is Signal.QCI:
            scores = qci_scores(model, lay, hq, range(w, w + config.probe))
        elif config.signal is Signal.QCI_LAST:
            scores = qci_last_scores(model, lay, hq, w)
        parts, order = (), None
        if config.signal is Signal.FUSED:
            parts = (kv_dev_probe(model, lay, h, replace(config, probe=0), keys, values)[1],
                     qci_last_scores(model, lay, hq, w))
            scores, order = fused_ranking(*parts)
        if order is not None:
            selected = sorted(order[:coverage_count(coverage, lay.num_context)])
        else:
            selected = select_position(lay, coverage) if scores is None else select_top(scores, coverage)
        rows = torch.cat([lay.num_prefix + torch.tensor(selected, dtype=torch.long),
                          lay.suffix_positions()])  # [R] sorted positions
        h_rows = h[rows]  # [R, hidden] entering the first Patch layer
        for index in range(start, num_layers):
            h_rows, (keys[index], values[index]) = patch_layer(model, lay, index, h_rows, rows,
                                                               overwrite_selected)
        return _finish(model, h_rows, selected, scores, keys, values, parts)


def _finish(model: Decoder, h: torch.Tensor, selected: list[int], scores, keys: dict,
            values: dict, parts: tuple = ()) -> Reference:
    logits = model.head(model.norm(h[-1:]))[0]  # [vocab]
    num_layers = model.num_layers
    return Reference(logits, selected, scores, [keys[i] for i in range(num_layers)],
                     [values[i] for i in range(num_layers)], parts)
