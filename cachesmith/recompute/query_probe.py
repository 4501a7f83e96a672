"""The query-driven Probe signals: only the question's rows run through the probe layers, and their
attention over the cached context scores each context row.

In: the model, the batch's `Sequence`s, the question rows' hidden states `hq`
[num_suffix_rows_of_the_batch, hidden], the layers to run, the runner's hooks and its per-layer
report (`after`). Out: per request, scores [num_context]: attention probability summed over the
layers, heads and question tokens (QCI), or that of the last layer after the question rows ran up
to it over the prefix and themselves (FusionRAG's `qci_last`). The cache rows they write are all
rewritten by Patch: the runner rewinds to the warm-up depth afterwards.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from cachesmith.model import Decoder
from cachesmith.recompute import signals
from cachesmith.recompute.attention import attend_with_probs
from cachesmith.recompute.hooks import RunnerHooks
from cachesmith.recompute.sequence import Sequence, fill_cached_rows

# (hooks, layer, phase, rows computed, KV rows read) -> the hooks' verdict (`BatchRunner._after`)
AfterLayer = Callable[[RunnerHooks, int, str, int, int], object]


def qci_scores(model: Decoder, seqs: list[Sequence], hq: torch.Tensor, layers: range, hooks: RunnerHooks,
               after: AfterLayer) -> list[torch.Tensor]:
    """Query rows `hq` only, over the cached context; probabilities summed over probe layers,
    heads and query tokens. The cache rows it writes are all rewritten by Patch (the rewind)."""
    scores = [torch.zeros(s.num_context, device=model.device) for s in seqs]  # each [num_context]
    rope = model.rope
    for index in layers:
        hooks.before_layer(index, "probe")
        layer = model.layers[index]
        q, k, v = layer.qkv(layer.input_norm(hq))  # q [rows, H, D]; k, v [rows, Hkv, D]
        outs, a = [], 0
        for i, s in enumerate(seqs):
            b, sfx = a + s.num_suffix, slice(s.suffix_start, s.num_tokens)
            fill_cached_rows(model, s, index)
            s.cache.write(index, s.suffix_start, rope.apply(k[a:b], s.cos[sfx], s.sin[sfx]), v[a:b])
            keys, values = s.cache.view(index, s.num_tokens)
            pos = torch.arange(s.num_tokens, device=hq.device)
            qi = rope.apply(q[a:b], s.cos[sfx], s.sin[sfx])
            out, probs = attend_with_probs(qi, keys, values, pos[sfx], pos)
            scores[i] += signals.qci_from_probs(probs, s)
            outs.append(out)
            a = b
        hq = layer.mlp_block(hq.add_(layer.out_proj(torch.cat(outs))))
        after(hooks, index, "probe", hq.shape[0], sum(s.suffix_start for s in seqs))
    return scores


def qci_last_scores(model: Decoder, seqs: list[Sequence], hq: torch.Tensor, start: int, hooks: RunnerHooks,
                    after: AfterLayer) -> list[torch.Tensor]:
    """FusionRAG: query rows run [start, L-1) over the prefix and themselves only, then the
    last layer scores their attention over the cached context."""
    last = model.num_layers - 1
    rope = model.rope
    key_positions = [_probe_positions(s, hq.device) for s in seqs]  # the same in every layer
    for index in range(start, last):
        hooks.before_layer(index, "probe")
        layer = model.layers[index]
        q, k, v = layer.qkv(layer.input_norm(hq))
        outs, a = [], 0
        for s, kpos in zip(seqs, key_positions):
            b, sfx = a + s.num_suffix, slice(s.suffix_start, s.num_tokens)
            keys, values = rope.apply(k[a:b], s.cos[sfx], s.sin[sfx]), v[a:b]
            if s.request.prefix is not None:  # exact, so the query-only pass may see it
                pre = s.request.prefix
                pk = rope.apply(pre.keys[index], s.cos[:s.num_prefix], s.sin[:s.num_prefix])
                keys, values = torch.cat([pk, keys]), torch.cat([pre.values[index], values])
            qi = rope.apply(q[a:b], s.cos[sfx], s.sin[sfx])
            outs.append(attend_with_probs(qi, keys, values, kpos[s.num_prefix:], kpos)[0])
            a = b
        hq = layer.mlp_block(hq.add_(layer.out_proj(torch.cat(outs))))
        after(hooks, index, "probe", hq.shape[0], sum(s.num_prefix for s in seqs))
    return qci_scores(model, seqs, hq, range(last, last + 1), hooks, after)


def _probe_positions(s: Sequence, device: torch.device) -> torch.Tensor:
    """True positions [num_prefix + num_suffix] of the keys a query-only pass sees (prefix, then
    suffix), built on the device: a host-built tensor is a copy to the device."""
    return torch.cat([torch.arange(s.num_prefix, device=device),
                      torch.arange(s.suffix_start, s.num_tokens, device=device)])
