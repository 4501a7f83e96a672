"""What flows into and out of a scheduler: queued requests (no tensors) and the next batch.

In: `QueuedRequest`s (arrival, SLO, token counts). Out: a `ScheduleDecision`: which requests run
next, under what latency budget, and how (the planner inside its band, a static preset, or full
reuse for requests that cannot make their SLO anyway).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachesmith.errors import InputError
from cachesmith.planner import BatchShape
from cachesmith.recompute import RecomputeConfig


@dataclass(eq=False)
class QueuedRequest:
    """The scheduler's view of one request, made once per request: by the serving front at its
    arrival (token counts guessed from its text, then `measured` once tokenized), else by the
    engine's admission. Compared by identity: two requests may have equal counts."""
    request_id: int
    arrival_s: float
    slo_s: float
    context_tokens: int
    suffix_tokens: int
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        self._check()

    def measured(self, context_tokens: int, suffix_tokens: int, prefix_tokens: int) -> "QueuedRequest":
        """The counts of the tokenized prompt in place of those guessed at arrival (the same view:
        the queue's promises name it)."""
        self.context_tokens, self.suffix_tokens, self.prefix_tokens = context_tokens, suffix_tokens, prefix_tokens
        self._check()
        return self

    def counts(self) -> tuple[int, int, int]:
        return self.context_tokens, self.suffix_tokens, self.prefix_tokens

    def _check(self) -> None:
        if self.context_tokens < 0:  # 0: a plain chat, no documents
            raise InputError(f"request {self.request_id}: context_tokens={self.context_tokens} must be >= 0")
        if self.suffix_tokens < 1:
            raise InputError(f"request {self.request_id}: suffix_tokens must be >= 1")

    @property
    def deadline_s(self) -> float:
        return self.arrival_s + self.slo_s

    @property
    def num_tokens(self) -> int:
        return self.context_tokens + self.suffix_tokens + self.prefix_tokens


@dataclass(frozen=True)
class ScheduleDecision:
    request_ids: tuple[int, ...]
    budget_s: float  # seconds from the decision for the batch's TTFT
    mode: str  # "planned", "static" or "full_reuse"
    static_plan: RecomputeConfig | None = None  # for "static" and "full_reuse"
    coverage: float = 0.0  # full reuse: coverage the link's idle time pays for
    expected_on_time: int = 0  # requests (batch + modeled queue) the decision expects on time
    num_candidates: int = 0
    decision_s: float = 0.0
    doomed_ids: tuple[int, ...] = field(default_factory=tuple)  # waiting, infeasible (`scheduler.feasibility`)
    kv_window_layers: int | None = None  # partial KV allocation: layers resident per request
    # seconds from the decision past which a member, or a waiting request that makes its deadline
    # behind the batch, would miss it (>= budget_s); None: the budget is the limit
    limit_s: float | None = None


def batch_shape(requests: Sequence[QueuedRequest]) -> BatchShape:
    """The cost model's view of running `requests` as one batch."""
    return BatchShape(tuple(r.context_tokens for r in requests), tuple(r.suffix_tokens for r in requests),
                      tuple(r.prefix_tokens for r in requests))
