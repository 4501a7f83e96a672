"""What a batch run carries between its phases and hands back.

`RecomputeOutput` is a request's result (logits, its assembled KV cache, the selection); `Ranked` a
batch after WarmUp and Probe, every request ranked and nothing selected (what a `PatchFork` keeps
and copies); `PatchRows` the rows one request computes in Patch layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cachesmith.model import KVCache
from cachesmith.recompute import split_attention
from cachesmith.recompute.attention import ScatteredAttention
from cachesmith.recompute.sequence import Sequence


@dataclass
class RecomputeOutput:
    logits: torch.Tensor  # [vocab] float32, last position
    cache: KVCache  # assembled KV of all S positions, ready for decoding
    selected: torch.Tensor  # context indices recomputed in the last Patch layer (CPU, sorted)
    scores: torch.Tensor | None  # [N] selection scores (None for warm-up-only plans)
    entropy: torch.Tensor | None  # 0-dim normalized entropy of layer-0 QCI scores (when w >= 1)
    num_context: int
    num_suffix: int

    @property
    def qci_entropy(self) -> float | None:
        """`entropy` as a float; read after the first token, when the device has caught up."""
        return None if self.entropy is None else float(self.entropy)

    @property
    def first_token(self) -> int:
        return int(torch.argmax(self.logits))


@dataclass
class PatchRows:
    """Rows a request computes in Patch layers: selected context + suffix, sorted by position."""
    positions: torch.Tensor  # [num_rows] on the model device
    cos: torch.Tensor  # [num_rows, 1, head_dim]
    sin: torch.Tensor
    attention: ScatteredAttention | split_attention.SplitAttention


@dataclass
class Ranked:
    """A batch after WarmUp and Probe: every request ranked, nothing selected yet."""
    seqs: list[Sequence]
    h: torch.Tensor  # [sum S, hidden] every row entering the first Patch layer
    patch_start: int
    start_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # kv_dev: normed rows, K, V of patch_start
    outputs: list[RecomputeOutput] | None = None  # set when no Patch layer is left


def num_cloned(seq: Sequence, num_written: int) -> int | None:
    """Layers a copy of `seq`'s cache needs: those written so far, or all of them (None) when its
    chunks were stitched into every layer up front."""
    return None if seq.is_stitched else num_written
