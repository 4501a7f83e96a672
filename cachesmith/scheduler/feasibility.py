"""Which requests can still be answered in time: the one rule that the scheduler, the live loop
and the server's admission share.

A request is *feasible* at a margin m when

    its wait so far + the work ahead of it + its own work <= m x its SLO,

every work priced at its cheapest plan (full reuse: no row recomputed) on the cost model at the
pace learned on the serving machine. The work ahead is what already runs (the rest of the batch
prefilling, the new documents of admissions in progress) and the *feasible* requests due no later
than it, batched `max_batch_size` at a time in deadline order; its own is the prefill of its
documents not yet stored, then its batch alone. One walk in deadline order decides every request
of a queue (`walk`): what is infeasible is not work ahead of anyone, since it is either shed or
served only where that costs no one in time.

The scheduler calls a request *doomed* when it is infeasible at m = 1 (it cannot make its SLO);
the server refuses at arrival, or sheds at a batch boundary, one infeasible at m = `--shed-late`.
The price errs early: what it leaves out (decode steps between batches, recomputation bought with
slack) only makes a first token later. At arrival, before tokenizing, a request's own token counts
are guessed from its text (`SizeGuess`); the exact price replaces the guess after tokenizing.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.planner import BatchShape, Planner
from cachesmith.scheduler.types import QueuedRequest, batch_shape

FULL_REUSE = ("position", 0, 0)  # signal, warm-up, probe of the plan that recomputes nothing
FULL_PREFILL = "position"  # the signal a full prefill is priced (and paced) as
PREFILL_WINDOW = 64  # chunk prefills the measured prefill pace is the median of
MIN_PREFILLS = 2  # measured before their pace replaces the planner's
MIN_PREFILL_PACE, MAX_PREFILL_PACE = 0.25, 8.0  # one page-fault storm must not swing every estimate
SIZE_WINDOW = 64  # prompts the size guess at arrival learns from
MAX_KEPT_SHAPES = 4096  # request shapes whose raw price alone is kept
DEFAULT_CHARS_PER_TOKEN = 4.0  # English text on a BPE vocabulary, until the server has tokenized a prompt


@dataclass(frozen=True)
class SheddingConfig:
    """Refuse or shed a request not feasible at `max_lateness` times its SLO (None: never refuse for
    lateness; requests wait their turn however late)."""
    max_lateness: float | None = 1.5

    def __post_init__(self) -> None:
        if self.max_lateness is not None and not 1.0 <= self.max_lateness <= 100.0:
            raise ConfigError(f"max_lateness={self.max_lateness}: must be between 1 and 100 times the SLO "
                              f"(or None: off)")

    @property
    def is_on(self) -> bool:
        return self.max_lateness is not None


@dataclass(frozen=True)
class PromptSize:
    """What a request's text says of its size before it is tokenized."""
    num_document_chars: tuple[int, ...]  # each text document's characters (a stored chunk named by id: 0)
    num_other_chars: int  # the question, system prompt, earlier turns and answer prefix


class SizeGuess:
    """Token counts guessed from characters, for pricing a request on arrival before it is
    tokenized: characters per token, and the share of text documents' tokens found not yet stored,
    both over the latest prompts tokenized. Until the first is seen, `DEFAULT_CHARS_PER_TOKEN` and
    every text document new (a server's first requests bring the documents it has not stored)."""

    def __init__(self, window: int = SIZE_WINDOW) -> None:
        self._seen: deque[tuple[int, int, int]] = deque(maxlen=window)  # (chars, tokens, new tokens)

    def observe(self, num_chars: int, num_tokens: int, num_new_tokens: int) -> None:
        """A prompt's text documents tokenized: their characters, tokens and tokens not yet stored."""
        if num_chars > 0 and num_tokens > 0:
            self._seen.append((num_chars, num_tokens, min(num_new_tokens, num_tokens)))

    @property
    def chars_per_token(self) -> float:
        chars, tokens = sum(s[0] for s in self._seen), sum(s[1] for s in self._seen)
        return chars / tokens if tokens else DEFAULT_CHARS_PER_TOKEN

    @property
    def new_share(self) -> float:
        tokens = sum(s[1] for s in self._seen)
        return sum(s[2] for s in self._seen) / tokens if tokens else 1.0

    def guess(self, size: PromptSize) -> tuple[tuple[int, ...], int, list[int]]:
        """Each document's tokens, the rest of the prompt's, and the documents' tokens to prefill."""
        per_token = self.chars_per_token
        docs = tuple(round(c / per_token) for c in size.num_document_chars)
        share = self.new_share
        return docs, max(1, round(size.num_other_chars / per_token)), [round(n * share) for n in docs if n]


@dataclass(frozen=True)
class TtftEstimate:
    waited_s: float  # from arrival to the estimate (tokenizing, waiting for the front)
    start_s: float  # from the estimate until the request's own work can start: the work ahead
    prefill_s: float  # its own work: its new documents' prefill,
    run_s: float  # then its batch alone at full reuse

    @property
    def own_s(self) -> float:
        return self.prefill_s + self.run_s

    @property
    def ttft_s(self) -> float:
        return self.waited_s + self.start_s + self.own_s

    def describe(self) -> str:
        return (f"{self.ttft_s:.2f} s = {self.waited_s:.2f} s waited + {self.start_s:.2f} s of work ahead + "
                f"{self.own_s:.2f} s of its own at its cheapest plan")


class DeadlinePricer:
    """Prices at the cheapest plan: a batch at full reuse, new documents' prefill (`observe_prefill`
    learns its pace), and a request's size from its text (`sizes`)."""

    def __init__(self, planner: Planner, max_batch_size: int) -> None:
        self.planner, self.max_batch_size = planner, max_batch_size
        self._prefill_paces: deque[float] = deque(maxlen=PREFILL_WINDOW)  # measured / priced, per chunk
        self.sizes = SizeGuess()
        self._alone_raw: dict[tuple[int, int, int, int], float] = {}  # (cost model, tokens) -> raw price

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A chunk prefill the store ran (`num_tokens`, measured `seconds`): the cost model prices a
        chunk's forward pass from the recompute runner's layer costs, and the two run at different
        speeds on a machine, so new documents are priced at the pace measured on the chunks."""
        priced = self._raw_prefill_s(num_tokens)
        if priced > 0 and seconds > 0:
            self._prefill_paces.append(seconds / priced)

    @property
    def prefill_pace(self) -> float:
        """Measured / priced chunk prefill time, the median of the latest (the planner's pace of a
        full prefill until `MIN_PREFILLS` were measured)."""
        paces = list(self._prefill_paces)
        if len(paces) < MIN_PREFILLS:
            return self.planner.pace(FULL_PREFILL, 0, None)
        return min(max(statistics.median(paces), MIN_PREFILL_PACE), MAX_PREFILL_PACE)

    def _raw_prefill_s(self, num_tokens: int) -> float:
        cost = self.planner.cost
        base = cost.full_prefill_ttft(BatchShape((0,), (1,), (0,)))
        return max(cost.full_prefill_ttft(BatchShape((num_tokens,), (1,), (0,))) - base, 0.0)

    def _raw(self, shape: BatchShape) -> float:
        signal, warmup, probe = FULL_REUSE
        return float(self.planner.cost.ttft(shape, signal, warmup, probe, np.zeros(shape.num_requests))[0])

    def _priced(self, shape: BatchShape) -> float:
        """Full reuse of `shape` as one batch, at the pace learned for such batches."""
        return self._raw(shape) * self.planner.pace(FULL_REUSE[0], FULL_REUSE[2], shape.num_tokens)

    def batch_s(self, batch: Sequence[QueuedRequest]) -> float:
        """`batch` run as one at full reuse."""
        return self.alone_s(batch[0]) if len(batch) == 1 else self._priced(batch_shape(batch))

    def cheapest_s(self, requests: Sequence[QueuedRequest]) -> float:
        """The requests run at full reuse, in deadline order, `max_batch_size` at a time."""
        ordered = sorted(requests, key=lambda r: r.deadline_s)
        size = self.max_batch_size
        return sum(self._priced(batch_shape(ordered[i:i + size])) for i in range(0, len(ordered), size))

    def prefill_s(self, num_new_tokens: Sequence[int]) -> float:
        """Documents not yet stored, each prefilled alone (as the store prefills a chunk): the cost
        model's price per token of a full prefill, without its per-batch terms, which price the
        recompute runner's layer loop that a chunk's plain forward pass does not run, at the pace
        measured on the chunks prefilled so far (`observe_prefill`)."""
        return self.prefill_pace * sum(self._raw_prefill_s(n) for n in num_new_tokens if n)

    def guessed(self, request_id: int, arrival_s: float, slo_s: float, size: PromptSize) -> QueuedRequest:
        """A request not yet tokenized: its view, with token counts guessed from its text (its
        front `measured`s them once tokenized)."""
        docs, other, _ = self.sizes.guess(size)
        return QueuedRequest(request_id, arrival_s, slo_s, sum(docs), other, 0)

    def alone_s(self, request: QueuedRequest) -> float:
        """`request`'s batch alone at full reuse. The raw price is kept per shape (a queue's walk
        prices each request at every batch boundary), the pace read each time: it learns."""
        key = (id(self.planner.cost), request.context_tokens, request.suffix_tokens, request.prefix_tokens)
        raw = self._alone_raw.get(key)
        if raw is None:
            if len(self._alone_raw) >= MAX_KEPT_SHAPES:
                self._alone_raw.clear()
            raw = self._alone_raw[key] = self._raw(batch_shape([request]))
        return raw * self.planner.pace(FULL_REUSE[0], FULL_REUSE[2], request.num_tokens)


@dataclass(frozen=True)
class Verdict:
    request: QueuedRequest
    estimate: TtftEstimate  # its first token at the earliest, behind the feasible work due first
    is_feasible: bool


def walk(pricer: DeadlinePricer, queue: Sequence[QueuedRequest], now: float, margin: float, busy_s: float = 0.0,
         candidate: QueuedRequest | None = None, num_new_tokens: Sequence[int] = ()) -> Iterator[Verdict]:
    """Each request of `queue` in deadline order, feasible or not at `margin` behind `busy_s` seconds
    of work already running and the feasible requests due no later than it. `candidate` (one not
    queued yet, with `num_new_tokens` of documents to prefill first) is walked after the queued
    requests due when it is; the walk may stop there."""
    ordered = sorted((r for r in queue if candidate is None or r.request_id != candidate.request_id),
                     key=lambda r: r.deadline_s)
    if candidate is not None:
        ordered.insert(bisect.bisect_right([r.deadline_s for r in ordered], candidate.deadline_s), candidate)
    done_s, batch, batch_s = busy_s, [], 0.0
    for r in ordered:
        prefill_s = pricer.prefill_s(num_new_tokens) if r is candidate else 0.0
        estimate = TtftEstimate(max(now - r.arrival_s, 0.0), done_s + batch_s, prefill_s, pricer.alone_s(r))
        is_feasible = estimate.ttft_s <= margin * r.slo_s
        yield Verdict(r, estimate, is_feasible)
        if is_feasible:
            batch.append(r)
            batch_s = pricer.batch_s(batch)
            if len(batch) == pricer.max_batch_size:
                done_s, batch, batch_s = done_s + batch_s, [], 0.0


def infeasible(pricer: DeadlinePricer, queue: Sequence[QueuedRequest], now: float, margin: float,
               busy_s: float = 0.0) -> list[Verdict]:
    """The requests of `queue` not feasible at `margin` (`walk`)."""
    return [v for v in walk(pricer, queue, now, margin, busy_s) if not v.is_feasible]


def judge(pricer: DeadlinePricer, request: QueuedRequest, now: float, ahead: Sequence[QueuedRequest],
          margin: float, busy_s: float = 0.0, num_new_tokens: Sequence[int] = ()) -> Verdict:
    """A request not queued yet, behind `ahead` (`walk`)."""
    return next(v for v in walk(pricer, ahead, now, margin, busy_s, request, num_new_tokens) if v.request is request)
