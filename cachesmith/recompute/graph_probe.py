"""The query-driven probes inside a prefill graph: a bucket's question rows alone through the probe
layers, their attention mass on each context row summed into scores, at static sizes.

In: a bucket (`graph_buffers.PrefillBuffers`: its slabs, static inputs and tables), the question
rows' hidden states entering the probe, the probe layers and whether the context is hidden from
them (FusionRAG's middle layers). Out: scores [B, S] float32 over the bucket's positions (zero off
the question rows' attention), as `query_probe.qci_scores` / `qci_last_scores` give them per
request; the eager functions stay the reference (`recompute.query_probe`).

Each probe layer writes its question rows' K/V into the slab at their positions (or at the trash
row, for padding slots). Those rows are all rewritten by Patch, which starts at or before every
probe layer (the eager probe's rewind), so no later reader sees them.
"""
from __future__ import annotations

import math

import torch


def question_rows(bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, Q] positions of each request's question rows, the trash row for padding slots,
    [B, Q] bool: which slots are real)."""
    key = bucket.key
    slot = torch.arange(key.num_suffix, device=bucket.positions.device)
    is_question = slot[None, :] < bucket.num_question[:, None]  # [B, Q]
    return torch.where(is_question, bucket.suffix_start[:, None] + slot, key.length - 1), is_question


def probe_input(bucket, h: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The question rows' hidden states entering the probe [B * Q, hidden]: rows of `h` (every row
    after the WarmUp layers, [B * S, hidden]) or, with no WarmUp layer, their embeddings."""
    B, S = bucket.key.num_rows, bucket.key.length
    flat = (torch.arange(B, device=rows.device)[:, None] * S + rows).view(-1)  # [B * Q]
    return bucket.model.embed(bucket.ids.view(-1)[flat]) if h is None else h[flat]


def query_scores(bucket, hq: torch.Tensor, layers: range, rows: torch.Tensor, is_question: torch.Tensor,
                 is_context: torch.Tensor, hides_context: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The question rows `hq` [B * Q, hidden] through `layers`, each over the slab's keys up to its
    position (with `hides_context`, over the prefix and the question only). -> (hq after the layers,
    scores [B, S]: attention probability on each context position, summed over the layers, heads
    and real question rows; zeros where `hides_context`)."""
    m, key = bucket.model, bucket.key
    B, Q = key.num_rows, key.num_suffix
    cos, sin = bucket.cos[rows.view(-1)], bucket.sin[rows.view(-1)]  # [B * Q, 1, D / 2]
    visible = bucket.positions[None, None, :] <= rows[:, :, None]  # [B, Q, S]
    if hides_context:
        visible = visible & ~is_context[:, None, :]
    weight = (is_question[:, None, :, None] & is_context[:, None, None, :]).float()  # [B, 1, Q, S]
    where = (torch.arange(B, device=rows.device)[:, None].expand(B, Q), rows)
    heads = (m.config.num_heads, m.config.num_kv_heads)
    scores = torch.zeros(B, key.length, device=hq.device)
    for i in layers:
        layer = m.layers[i]
        qk, v = layer.qk_v(layer.input_norm(hq))  # [B * Q, H + Hkv, D], [B * Q, Hkv, D]
        q, k = m.rope.apply(qk, cos, sin).split(heads, dim=1)
        keys, values = bucket.keys[:, i], bucket.values[:, i]  # [B, S, Hkv, D]
        keys.index_put_(where, k.reshape(B, Q, *k.shape[1:]))
        values.index_put_(where, v.reshape(B, Q, *v.shape[1:]))
        out, probs = attend_with_probs(q.reshape(B, Q, *q.shape[1:]), keys, values, visible)
        if not hides_context:
            scores += (probs * weight).sum(dim=(1, 2))
        hq = layer.mlp_block(hq.add_(layer.out_proj(out)))
    return hq, scores


def attention_probs(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`attention.attention_probs` of a batch, in float32 as it is: q [B, Q, H, D] over keys
    [B, S, Hkv, D] where `visible` [B, Q, S] -> probs [B, H, Q, S]. The query heads of one KV head
    go in together, so K is never repeated."""
    B, Q, H, D = q.shape
    Hkv = keys.shape[2]
    group = H // Hkv
    qg = q.float().reshape(B, Q, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Q, D)
    logits = torch.matmul(qg, keys.float().permute(0, 2, 3, 1)) / math.sqrt(D)  # [B, Hkv, group * Q, S]
    logits = logits.view(B, Hkv, group, Q, -1).masked_fill(~visible[:, None, None], float("-inf"))
    return torch.softmax(logits, dim=-1).view(B, H, Q, -1)


def attend_with_probs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_probs` and the attention output [B * Q, H * D] in q's dtype (values [B, S, Hkv, D])."""
    B, Q, H, D = q.shape
    Hkv = keys.shape[2]
    group = H // Hkv
    probs = attention_probs(q, keys, visible)  # [B, H, Q, S]
    out = torch.matmul(probs.view(B, Hkv, group * Q, -1), values.float().transpose(1, 2))  # [B, Hkv, group * Q, D]
    out = out.view(B, Hkv, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H * D)
    return out.to(q.dtype), probs


def fused_order(kv_scores: torch.Tensor, qci_scores: torch.Tensor, is_context: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`signals.fuse` of every request at once, on the device: [B, S] each -> (fused scores [B, S]
    (1 - better rank / N on the context), positions best first [B, S]). Off-context positions rank
    after every context one in both rankings, so they sort last."""
    B, S = kv_scores.shape
    ranks = torch.empty(2, B, S, dtype=torch.long, device=kv_scores.device)  # [signal, B, position] -> rank
    steps = torch.arange(S, device=kv_scores.device).expand(B, S)
    for row, scores in enumerate((kv_scores, qci_scores)):
        order = torch.sort(scores.masked_fill(~is_context, float("-inf")), dim=1, descending=True, stable=True).indices
        ranks[row].scatter_(1, order, steps)
    best = ranks.min(dim=0).values  # [B, S]
    order = torch.sort(2 * best + (ranks[0] > ranks[1]).long(), dim=1, stable=True).indices
    num_context = is_context.sum(dim=1, keepdim=True).clamp_min(1)  # [B, 1]
    return 1.0 - best.float() / num_context, order
