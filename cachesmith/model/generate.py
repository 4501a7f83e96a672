"""Greedy decoding from a filled KV cache (after full prefill or after an assembled recompute).

In: the decoder, the logits of the last prompt position, the cache. Out: generated token ids,
stopping at an end-of-sequence id (not included) or after `max_new_tokens`. `on_token(index, id)`
hears each kept token as soon as it is chosen (a server streams from it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cachesmith.errors import InputError
from cachesmith.model.decoder import Decoder
from cachesmith.model.kv_cache import KVCache


def greedy_decode(model: Decoder, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                  eos_token_ids: Iterable[int] | None = None,
                  on_token: Callable[[int, int], None] | None = None) -> list[int]:
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    stop = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    room = model.config.max_positions - cache.num_tokens
    out: list[int] = []
    logits = first_logits  # [vocab]
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        if token in stop:
            break
        out.append(token)
        if on_token is not None:
            on_token(step, token)
        if step + 1 == max_new_tokens or len(out) >= room:
            break
        logits = model.decode_step(token, cache)
    return out
