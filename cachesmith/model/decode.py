"""One decode step for many sequences at once: each sequence's next token over its own KV cache.

In: one token id per sequence and that sequence's `KVCache` (filled by a full prefill or by an
assembled recompute). Out: float32 logits `[num_seqs, vocab]`; each cache gains the new row.

On a CPU a decode step costs reading every weight once, so the sequences share one pass over the
weights (their rows go through each matmul together; see `model.linear` for the small-row kernels)
and only attention runs per sequence, over that sequence's own rows. Where loading measured the
native kernels faster (`model.native`), every layer of the step runs in one native call for up to
`native.MAX_NATIVE_ROWS` sequences; else the layer loop below runs torch's kernels (attention:
`model.row_attention`), with native attention where it was measured faster.
Sequences may sit at different positions and join or leave between steps. Given the ids and the
positions as device tensors (`Decoding` keeps them there between steps), a step reads no value back
from the device and copies nothing to it: each cache's length is known on the host, so every slice,
write and table bound is a host int (what a GPU needs to run the step without waiting). Equal to
`Decoder.decode_step` per sequence up to floating-point rounding (the identity tests hold it to 1e-4
in float32).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from cachesmith.errors import InputError
from cachesmith.model import native
from cachesmith.model.decoder import Decoder
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.row_attention import attend_one, key_split


@torch.inference_mode()
def decode_step(model: Decoder, token_ids: Sequence[int] | torch.Tensor, caches: Sequence[KVCache],
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits [num_seqs, vocab] of each sequence, after its `token_ids[j]` is appended.

    Ids given on the host are checked and copied to the device. A device tensor of ids [num_seqs]
    (ones the model chose: not read back to check them) and `positions` [num_seqs] on the device
    (each cache's `num_tokens`, kept there by the caller) are used in place: no host sync, no copy."""
    if len(token_ids) != len(caches) or not caches:
        raise InputError(f"decode_step: {len(token_ids)} token ids for {len(caches)} caches")
    cfg = model.config
    starts = [c.num_tokens for c in caches]
    if max(starts) >= cfg.max_positions:
        raise InputError(f"decode reached the model's maximum of {cfg.max_positions} positions")
    ids = token_ids if isinstance(token_ids, torch.Tensor) else model.as_token_tensor(token_ids)
    if positions is None:
        positions = torch.tensor(starts, device=model.device)
    cos, sin = model.rope.cos_sin_at(positions, max(starts) + 1)  # [num_seqs, 1, head_dim]
    h = model.embed(ids)  # [num_seqs, hidden]
    if is_fused(model, len(caches)):  # every layer in one native call
        h = native.decode_layers(h, model.native_layer_table, _native_layouts(caches, starts),
                                 cos.reshape(len(caches), -1).contiguous(), sin.reshape(len(caches), -1).contiguous())
        for cache, start in zip(caches, starts):
            cache.num_tokens = start + 1
        return model.head(model.norm(h))
    layouts = _native_layouts(caches, starts) if model.is_native_attention else None
    # each sequence attends over the same number of keys in every layer: decide its split once
    splits = None if layouts is not None else [key_split(start + 1, cfg.num_kv_heads, model.dtype, model.device)
                                               for start in starts]
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(layer.input_norm(h))  # [num_seqs, H | Hkv, D]
        q, k = model.rope.apply(q, cos, sin), model.rope.apply(k, cos, sin)
        if layouts is not None:  # one native call writes every sequence's new row and attends
            attn = native.decode_attention(q, cfg.num_kv_heads, layouts, i, k, v)  # [num_seqs, H * D]
        else:
            attn = _attend_each(q, k, v, i, caches, starts, splits, cfg.num_kv_heads)
        h = h + layer.out_proj(attn)
        h = layer.mlp_block(h)
    for cache, start in zip(caches, starts):
        cache.num_tokens = start + 1
    return model.head(model.norm(h))


def _native_layouts(caches: Sequence[KVCache], starts: Sequence[int]) -> native.KVLayouts:
    """The native kernel's descriptor of each cache (its row `start` written by the step)."""
    for cache, start in zip(caches, starts):
        cache.reserve(start + 1)  # the kernel writes in place: room first
    return native.kv_layouts([c.keys[0] for c in caches], [c.values[0] for c in caches],
                             [start + 1 for start in starts],
                             [(c.key_slab.stride(0), c.value_slab.stride(0)) for c in caches],
                             num_layers=caches[0].key_slab.shape[0])


def _attend_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, caches: Sequence[KVCache],
                 starts: Sequence[int], splits: Sequence, num_kv_heads: int) -> torch.Tensor:
    """Torch's path: write each sequence's new row, then attend each row alone -> [num_seqs, H * D]."""
    rows = []
    for j, (cache, start) in enumerate(zip(caches, starts)):
        cache.write(layer, start, k[j:j + 1], v[j:j + 1])
        keys, values = cache.view(layer, start + 1)
        rows.append(attend_one(q[j], keys, values, num_kv_heads, splits[j]))
    return torch.stack(rows)


def is_fused(model: Decoder, num_seqs: int) -> bool:
    """Whether a step of `num_seqs` rows runs every layer in one native call (`Decoder.use_native`)."""
    return model.native_layer_table is not None and num_seqs <= model.native_rows
