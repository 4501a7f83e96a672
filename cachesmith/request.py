"""A serving request and its result: what flows into `Engine` and what comes out per request.

In: `Request` (a workload instance, its arrival time and TTFT SLO, and the `StoredPrompt` its caller
keyed and stored, if any). Out: `RequestResult` (first
token time, the answer, whether it met its SLO and passed its quality gate, how it was run, or the
error that kept it from running), and on the live loop each token's time. Times are on the
engine's clock, in seconds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cachesmith.errors import InputError
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.instance import WorkloadInstance


@dataclass(frozen=True)
class StoredPrompt:
    """A prompt whose KV its caller stored already, each entry keyed once (in the caller's store
    namespace): the prefix's entry, each chunk's entry with its token count, and the suffix's
    token ids (always computed). The engine runs it as given, never re-deriving keys."""
    prefix_key: str | None
    num_prefix_tokens: int
    chunk_keys: tuple[str, ...]
    chunk_num_tokens: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    was_stored: tuple[bool, ...] = ()  # per chunk: False = prefilled for this request
    # (key, token ids, namespace) of the entries the caller stored: what rebuilds one evicted before staging
    sources: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.chunk_keys) != len(self.chunk_num_tokens):
            raise ValueError(f"{len(self.chunk_keys)} chunk keys but {len(self.chunk_num_tokens)} token counts")
        if (self.prefix_key is None) != (self.num_prefix_tokens == 0):
            raise ValueError("a prefix key needs its token count, and a count its key")


@dataclass(frozen=True)
class Request:
    request_id: int
    instance: WorkloadInstance
    slo_s: float
    arrival_s: float = 0.0
    sampling: SamplingParams = GREEDY  # how its tokens are chosen (its budget: instance.max_new_tokens)
    prompt: StoredPrompt | None = None  # stored by the caller (the server); None: from `instance`

    @classmethod
    def from_documents(cls, request_id: int, documents: Sequence[str], question: str, slo_s: float, *,
                       arrival_s: float = 0.0, max_new_tokens: int = 32, system: str = "",
                       answer_prefix: str = "", sampling: SamplingParams = GREEDY) -> Request:
        """A request of the user's own texts, not a benchmark's: task "custom", no gold (so not
        gated); `system` is the instruction before the documents ("" keeps the model's default)."""
        if isinstance(documents, str) or not all(isinstance(d, str) and d.strip() for d in documents):
            raise InputError(f"request {request_id}: documents must be a sequence of non-empty texts")
        if not question.strip():
            raise InputError(f"request {request_id}: question must be non-empty")
        instance = WorkloadInstance("custom", tuple(documents), question, (), prefix=system,
                                    answer_prefix=answer_prefix, max_new_tokens=max_new_tokens)
        return cls(request_id, instance, slo_s, arrival_s, sampling)


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
        return cls(request.request_id, request.arrival_s, request.slo_s, request.instance.task, error=error,
                   error_kind=kind)

    @classmethod
    def failed(cls, request: Request, error: str) -> "RequestResult":
        return cls.refused(request, error, "internal")
