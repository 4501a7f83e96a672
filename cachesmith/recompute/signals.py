"""Token selection signals: scores over a request's context tokens, ranking, and entropy.

In: fresh and cached K/V (kv_dev) or query attention probabilities (qci, qci_last). Out: a float
score per context token [N] (higher = recompute first), a ranking, and the selected set for a
coverage; `position` (EPIC) selects from chunk bounds alone, with no score or ranking.
"""
from __future__ import annotations

import math

import torch

from cachesmith.recompute.sequence import Sequence


def kv_deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor,
                 cached_v: torch.Tensor, target: str) -> torch.Tensor:
    """Per-token L2 deviation over heads and dims. All inputs [N, Hkv, D] -> [N] float32.

    K may be compared pre-RoPE or rotated (both sides alike): RoPE rotates each token's fresh and
    cached K by the same angles, which keeps the norm of their difference.
    """
    score = torch.zeros(fresh_k.shape[0], device=fresh_k.device)
    if target in ("k", "kv"):
        score += (fresh_k.float() - cached_k.float()).flatten(1).norm(dim=1)
    if target in ("v", "kv"):
        score += (fresh_v.float() - cached_v.float()).flatten(1).norm(dim=1)
    return score


def qci_from_probs(probs: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Attention probabilities [H, n, S_keys] -> summed mass on each context token [N]."""
    start = seq.context_start
    return probs[:, :, start:start + seq.num_context].sum(dim=(0, 1))


def entropy_of(scores: torch.Tensor) -> torch.Tensor:
    """Entropy of scores [N] (as a distribution) divided by log(N), as a 0-dim float64 tensor on the
    scores' device: 1 = uniform (also when every score is 0), 0 = one token. Nothing is read back
    to the host, so the layer loop does not wait for the device here."""
    n = scores.numel()
    if n <= 1:
        return torch.zeros((), dtype=torch.float64, device=scores.device)
    p = scores.double().clamp_min(0)
    total = p.sum()
    p = p / total.clamp_min(1e-300)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum() / math.log(n)
    return torch.where(total > 0, entropy, torch.ones_like(entropy))


def normalized_entropy(scores: torch.Tensor) -> float:
    """`entropy_of` read back as a float."""
    return float(entropy_of(scores))


def fuse(kv_scores: torch.Tensor, qci_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank fusion of two rankings of the same N tokens: the rankings interleaved, KV deviation's
    k-th token then the query's k-th (a token already taken is skipped), so the top k are the
    union of both signals' top ~k/2: a token either signal flags is recomputed, which hedges
    between KV deviation (what isolation changed) and the query's attention (what the answer
    reads). Each token sorts by its better rank, the KV side first on a tie, so the order reads
    nothing below a token's better rank.
    Returns (scores [N] float32: 1 - better rank / N, ranking [N])."""
    n = kv_scores.numel()
    ranks = torch.empty(2, n, dtype=torch.long)  # [signal, token] -> rank
    for row, sc in enumerate((kv_scores, qci_scores)):
        ranks[row, rank(sc)] = torch.arange(n)
    best = ranks.min(dim=0).values  # [N]
    order = torch.sort(2 * best + (ranks[0] > ranks[1]).long()).indices  # unique keys
    return 1.0 - best.float() / max(n, 1), order


def rank(scores: torch.Tensor) -> torch.Tensor:
    """Context indices, best first; ties keep position order (stable sort)."""
    return torch.sort(scores.float().cpu(), descending=True, stable=True).indices


def num_selected(coverage: float, num_context: int) -> int:
    return min(num_context, math.ceil(coverage * num_context - 1e-9))


def select(seq: Sequence, coverage: float) -> torch.Tensor:
    """Sorted context indices recomputed at `coverage`.

    `position` follows EPIC: the first ceil(r * |c|) tokens of every chunk but the first. Every
    other signal takes the top ceil(r * N) of the ranking. At r = 100% every context token is taken.
    """
    if seq.is_position_signal:
        return chunk_heads(seq.chunk_starts, seq.num_context, coverage) if coverage < 1.0 \
            else torch.arange(seq.num_context)
    return torch.sort(seq.ranking[: num_selected(coverage, seq.num_context)]).values


def chunk_heads(chunk_starts: list[int], num_context: int, coverage: float) -> torch.Tensor:
    """EPIC's selection below full coverage, sorted (context indices, on the host). How many of
    each chunk's first tokens are taken (none of the first chunk's) is known on the host, so the indices come from
    arithmetic of a known size: no data-dependent shape, and no work per chunk."""
    bounds = list(chunk_starts) + [num_context]
    num_taken = [0] + [num_selected(coverage, b - a) for a, b in zip(bounds[1:-1], bounds[2:])]
    total = sum(num_taken)
    counts = torch.tensor(num_taken, dtype=torch.long)  # [num_chunks]
    firsts = torch.tensor(bounds[:-1], dtype=torch.long)  # [num_chunks]
    taken_before = torch.tensor([0] + num_taken[:-1], dtype=torch.long).cumsum(0)  # [num_chunks]
    # [total] each taken token: its chunk's start + its rank among the chunk's taken tokens
    return torch.repeat_interleave(firsts - taken_before, counts, output_size=total) + torch.arange(total)
