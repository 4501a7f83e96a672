"""A serving request and its result: what flows into `Engine` and what comes out per request.

In: `Request`, what the engine needs of one request and nothing more: its prompt as stored entries
(`StoredPrompt`: the prefix's and each chunk's key with its token count, and the question's token
ids), its arrival time and TTFT SLO, how many tokens to generate and how, and what its answer is
scored against. Whoever holds the texts (the server, a benchmark, `RagPipeline.stored_prompt`)
tokenizes and keys them once; the engine never sees a text. Out: `RequestResult` (first token
time, the answer, whether it met its SLO and passed its quality gate, how it was run, or the error
that kept it from running), and on the live loop each token's time. Times are on the engine's
clock, in seconds.

The rules every request obeys live here (`check_slo`, `check_max_tokens`, `check_fits`), and each
is checked once, where a value enters: the server's front (naming the client's fields, before any
costly work), `RagPipeline.request` for a Python caller, the connector's planner. A `Request` is
typed and trusted: the engine checks only its own limits (a stored prompt, the KV capacity).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cachesmith.errors import InputError
from cachesmith.kvstore import StoredPrompt
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.scoring import Expected


DEFAULT_SLO_S = 5.0  # a request's TTFT SLO when its caller names none (server, connector, `ask`)
MAX_SLO_S = 3600.0  # the longest SLO a served request may ask for


def check_slo(value: float, field: str = "slo_s", max_slo_s: float = math.inf, min_slo_s: float = 0.0,
              scale: float = 1.0) -> None:
    """An SLO is a positive, finite number of seconds, at least `min_slo_s` (when set) and at most
    `max_slo_s`. `value` is in the field's own unit, `scale` of them to the second (1e3 for a
    field in ms), and the error names the field with the value as it was given."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    seconds = value / scale if is_number else math.nan
    if not (math.isfinite(seconds) and 0 < seconds and min_slo_s <= seconds <= max_slo_s):
        low = f" of at least {min_slo_s * scale:.10g}" if min_slo_s > 0 else ""
        high = "" if math.isinf(max_slo_s) else f" and at most {max_slo_s * scale:.10g}"
        raise InputError(f"{field}={value!r}: must be a positive number{low}{high}")


def check_max_tokens(value: int, field: str = "max_new_tokens", limit: int | None = None) -> None:
    """A token budget is an integer of at least 1 (and at most `limit`, when set); the error names
    the field."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not (is_int and 1 <= value and (limit is None or value <= limit)):
        bound = "an integer >= 1" if limit is None else f"an integer between 1 and {limit}"
        raise InputError(f"{field}={value!r}: must be {bound}")


def check_fits(num_prompt_tokens: int, max_new_tokens: int, max_positions: int, field: str,
               budget_field: str = "max_new_tokens") -> None:
    """A prompt and the tokens it may generate fit in the model's positions; the error names the
    field at fault and the caller's name for the token budget."""
    if num_prompt_tokens + max_new_tokens > max_positions:
        raise InputError(f"{field}: the prompt's {num_prompt_tokens} tokens + {budget_field} {max_new_tokens} "
                         f"exceed the model's {max_positions} positions")


@dataclass(frozen=True)
class Request:
    """One request to the engine, the one type it carries from submission to the executor. `prompt`
    None: a simulated request (the simulator's executor reads its token counts from its measured
    outcome; the model's executor refuses it)."""
    request_id: int
    prompt: StoredPrompt | None
    slo_s: float
    max_new_tokens: int = 16
    arrival_s: float = 0.0
    sampling: SamplingParams = GREEDY  # how its tokens are chosen
    expected: Expected = Expected()  # the task (the planner's curves, the gate's metric) and gold

    @property
    def task(self) -> str:
        return self.expected.task


@dataclass
class RequestResult:
    request_id: int
    arrival_s: float
    slo_s: float
    task: str = ""
    error: str | None = None  # set when the request was refused or failed (nothing else below is)
    first_token_s: float | None = None  # clock time of the first token
    answer: str = ""
    is_passed: bool | None = False  # the quality gate; None: not gated (a served request without gold)
    mode: str = ""  # "planned", "static" or "full_reuse"
    plan: str = ""  # the (S, w, p) plan label the batch ran
    coverage: float = 0.0  # this request's coverage as planned (before any monitor lowering)
    num_context_tokens: int = 0
    num_recomputed: int = 0
    batch_id: int = -1
    batch_size: int = 0
    qci_entropy: float | None = None
    num_prompt_tokens: int = 0  # prefix + context + suffix
    num_output_tokens: int = 0  # generated (the first token included, end-of-sequence not)
    error_kind: str | None = None  # "invalid" (refused), "internal" (a batch failed), "cancelled"
    batch_s: float | None = None  # the batch's measured (or simulated) TTFT: staging to its first tokens
    num_cached_prefix: int = 0  # prompt prefix tokens whose KV was read from the store (exact)
    reused_by_chunk: tuple[int, ...] = ()  # per context chunk, its tokens read from the store, not recomputed
    logprobs: list | None = None  # per generated token, a `TokenLogprob` (when the request asked)
    output_token_ids: tuple[int, ...] = ()
    # the planner's price of the batch (its paced cost-model TTFT; None: a static plan) and how many
    # times the runtime monitor re-planned it: judging the price against `batch_s` needs both
    planned_s: float | None = None
    num_replans: int = 0
    # clock time of each generated token as it was produced (the live loop: end-to-end latency and the
    # gaps between tokens); empty on the replay clock, which decoding does not advance
    token_times_s: tuple[float, ...] = ()

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from stored KV and not recomputed: the exact prefix and the reused
        context rows."""
        return self.num_cached_prefix + sum(self.reused_by_chunk)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def last_token_s(self) -> float | None:
        """Clock time of the last generated token (None: none was kept, or tokens were not timed)."""
        return self.token_times_s[-1] if self.token_times_s else None

    @property
    def is_on_time(self) -> bool:
        return self.ttft_s is not None and self.ttft_s <= self.slo_s

    @property
    def is_qsa(self) -> bool:
        """Quality-gated SLO attainment (paper Eq. 1): on time and above the gate."""
        return self.is_on_time and self.is_passed is True

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft_s": self.ttft_s, "is_on_time": self.is_on_time, "is_qsa": self.is_qsa}

    @property
    def is_internal_error(self) -> bool:
        """The error is the server's (a failed batch), not the request's."""
        return self.error_kind == "internal"

    @classmethod
    def refused(cls, request: Request, error: str, kind: str = "invalid") -> "RequestResult":
        return cls(request.request_id, request.arrival_s, request.slo_s, request.task, error=error,
                   error_kind=kind)

    @classmethod
    def failed(cls, request: Request, error: str) -> "RequestResult":
        return cls.refused(request, error, "internal")
