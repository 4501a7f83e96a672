"""Token selection signals: scores over a request's context tokens, ranking, and entropy.

In: fresh and cached K/V (kv_dev), query attention probabilities (qci, qci_last), or chunk
boundaries (position). Out: a float score per context token [N] (higher = recompute first), a
ranking, and the selected set for a coverage.
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


def normalized_entropy(scores: torch.Tensor) -> float:
    """Entropy of scores (as a distribution) divided by log(N): 1 = uniform, 0 = one token."""
    n = scores.numel()
    if n <= 1:
        return 0.0
    p = scores.double().clamp_min(0)
    total = p.sum()
    if total <= 0:
        return 1.0
    p = p / total
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum()
    return float(entropy / math.log(n))


def position_scores(seq: Sequence) -> torch.Tensor:
    """EPIC ranking: earlier in its chunk ranks higher; the first chunk ranks after all others."""
    scores = torch.empty(seq.num_context)
    bounds = seq.chunk_starts + [seq.num_context]
    for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        offset = -(2 * seq.num_context) if c == 0 else 0.0
        scores[a:b] = offset - torch.arange(b - a, dtype=torch.float)
    return scores


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
    if seq.is_position_signal and coverage < 1.0:
        picks = []
        bounds = seq.chunk_starts + [seq.num_context]
        for a, b in list(zip(bounds[:-1], bounds[1:]))[1:]:
            picks.append(torch.arange(a, a + num_selected(coverage, b - a)))
        chosen = torch.cat(picks) if picks else torch.empty(0, dtype=torch.long)
    else:
        chosen = seq.ranking[: num_selected(coverage, seq.num_context)]
    return torch.sort(chosen).values
