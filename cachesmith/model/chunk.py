"""Chunk KV computed in isolation, carrying pre-RoPE K so it can be placed at any offset.

In: a chunk's token ids. Out: `ChunkKV` with per-layer pre-RoPE K and V, computed at positions
0..T-1 with no other context. `keys_at(layer, offset)` rotates K to positions offset..offset+T-1,
which equals exactly what the same tokens would get at that offset
(see docs/adr/0013-pre-rope-chunk-kv.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachesmith.errors import InputError
from cachesmith.model.decoder import Decoder


@dataclass(frozen=True)
class ChunkKV:
    token_ids: tuple[int, ...]
    keys: torch.Tensor  # [num_layers, num_tokens, num_kv_heads, head_dim], pre-RoPE
    values: torch.Tensor  # [num_layers, num_tokens, num_kv_heads, head_dim]
    model_fingerprint: str

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.shape[1] != len(self.token_ids):
            raise InputError(
                f"ChunkKV shapes disagree: keys {tuple(self.keys.shape)}, values "
                f"{tuple(self.values.shape)}, {len(self.token_ids)} token ids")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def keys_at(self, model: Decoder, layer: int, offset: int) -> torch.Tensor:
        """Rotated K [num_tokens, Hkv, D] of `layer` placed at positions offset..offset+T-1."""
        cos, sin = model.rope.cos_sin_range(offset, offset + self.num_tokens)  # positions known on the host
        return model.rope.apply(self.keys[layer], cos, sin)

    def check_compatible(self, model: Decoder, field: str = "chunk") -> None:
        if self.model_fingerprint != model.fingerprint:
            raise InputError(f"{field} was computed by model {self.model_fingerprint}, "
                             f"not by the loaded model {model.fingerprint}")
        if self.dtype != model.dtype:
            raise InputError(f"{field} has dtype {self.dtype}, the model runs in {model.dtype}")


def prefill_chunk(model: Decoder, token_ids: Sequence[int] | torch.Tensor) -> ChunkKV:
    """Compute one chunk's KV in isolation (positions 0..T-1, nothing before it)."""
    ids = model.as_token_tensor(token_ids, field="chunk token_ids")
    cache = model.new_cache(ids.numel())
    pre_rope_keys: list[torch.Tensor] = []
    model.forward(ids, cache=cache, pre_rope_keys=pre_rope_keys)
    values = torch.stack([cache.view(i)[1] for i in range(model.num_layers)])
    # ids given on the host are taken as given: reading a device tensor back would sync
    host_ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    return ChunkKV(
        token_ids=tuple(int(t) for t in host_ids),
        keys=torch.stack(pre_rope_keys),
        values=values,
        model_fingerprint=model.fingerprint,
    )


def extend_chunk(model: Decoder, base: ChunkKV, token_ids: Sequence[int]) -> ChunkKV:
    """The KV of `base`'s tokens followed by `token_ids`, all from position 0: `base`'s rows are
    reused and only the new tokens run (over them), which is exact because `base` is itself a prefill
    from position 0 with nothing before it (a conversation's stored earlier turns)."""
    base.check_compatible(model, "base chunk")
    ids = list(token_ids)  # checked and copied to the device once, by `extend`
    n = base.num_tokens
    cache = model.new_cache(n + len(ids))
    cos, sin = model.rope.cos_sin_range(0, n)
    for layer in range(model.num_layers):
        cache.write(layer, 0, model.rope.apply(base.keys[layer], cos, sin), base.values[layer])
    cache.num_tokens = n
    pre_rope_keys: list[torch.Tensor] = []
    model.extend(ids, cache, pre_rope_keys=pre_rope_keys)
    keys = torch.cat([base.keys, torch.stack(pre_rope_keys)], dim=1)
    values = cache.value_slab[:, :n + len(ids)].clone(memory_format=torch.contiguous_format)
    cache.release()
    return ChunkKV(base.token_ids + tuple(int(t) for t in token_ids), keys, values, model.fingerprint)
