"""Buckets of interchangeable requests and the compositions drawn from them (paper §5.2).

In: live requests, the current time, a slack quantum and length edges. Out: buckets (requests of
similar deadline and context length, most urgent first within each) sorted by urgency, and
compositions: how many requests to draw from each bucket, most urgent buckets first, capped.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from cachesmith.scheduler.types import QueuedRequest


def bucketize(requests: Sequence[QueuedRequest], now: float, slack_quantum_s: float,
              length_edges: Sequence[int]) -> list[list[QueuedRequest]]:
    groups: dict[tuple[int, int], list[QueuedRequest]] = {}
    for r in requests:
        slack = max(r.deadline_s - now, 0.0)
        key = (int(math.floor(slack / slack_quantum_s)), sum(r.context_tokens > e for e in length_edges))
        groups.setdefault(key, []).append(r)
    buckets = [sorted(g, key=lambda r: (r.deadline_s, r.arrival_s)) for g in groups.values()]
    return sorted(buckets, key=lambda b: (b[0].deadline_s, b[0].context_tokens))


def compositions(sizes: Sequence[int], max_batch: int, max_count: int) -> Iterator[tuple[int, ...]]:
    """Count vectors (k_b <= sizes[b], 1 <= sum <= max_batch), the most urgent buckets first:
    all compositions that use only bucket 0, then those whose last used bucket is 1, and so on;
    larger counts first within each. Stops after `max_count`, never walking invalid vectors."""
    n = len(sizes)

    def head(i: int, last: int, left: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if i == last:
            for k in range(min(sizes[last], left), 0, -1):
                yield prefix + (k,) + (0,) * (n - last - 1)
            return
        for k in range(min(sizes[i], left - 1), -1, -1):  # leave room for >= 1 from `last`
            yield from head(i + 1, last, left - k, prefix + (k,))

    produced = 0
    for last in range(n):
        for combo in head(0, last, max_batch, ()):
            yield combo
            produced += 1
            if produced >= max_count:
                return
