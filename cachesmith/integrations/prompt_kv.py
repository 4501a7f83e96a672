"""cachesmith's KV of one prompt, for an engine that finishes and decodes it (the vLLM connector).

In: a prompt's token ids and the request's cachesmith parameters, as a client sends them
(`{"num_prefix_tokens": P, "chunk_token_counts": [n_1, ...], "method": ..., "slo_ms": ...}`), how
long the request has already waited, the store namespace its chunks live in (`namespace_of` of the
request's `cache_salt`; "" without one), and optionally the plan an earlier build of the same
request ran. Out: `ConnectorParams` (validated, or an `InputError` that names the field) and, from
`build_prompt_kv`, a `PromptKV`: the `KVCache` of the whole prompt under the request's plan, a
`LoadReport` of what it took (which chunks the store served, which were prefilled and stored, the
plan and its budget) and the `PromptPlan` it ran, so that a rebuild runs the same one.

`method` "cachesmith" (the default) asks the system's planner for the plan of the request alone
under what is left of `slo_ms` (`plan_one.one_planner`, as `cachesmith ask` plans); any other
value is a fixed method (`full_prefill`, `full_reuse`, `<preset>@<coverage>`). Nothing here
imports vLLM, so it is tested on tiny models in `make test`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

from cachesmith.errors import CachesmithError, InputError
from cachesmith.methods import parse_method
from cachesmith.model.assets import DEFAULT_MODEL
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import RagPipeline
from cachesmith.plan_one import one_planner
from cachesmith.recompute import RecomputeConfig
from cachesmith.request import DEFAULT_SLO_S, MAX_SLO_S, Request, check_slo

PARAMS_KEY = "cachesmith"  # the key of our parameters inside a request's kv_transfer_params
PLANNED = "cachesmith"
MIN_BUDGET_S = 1e-3  # a request already past its SLO is planned for the least time (full reuse)
_FIELDS = ("num_prefix_tokens", "chunk_token_counts", "method", "slo_ms")


def _count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{PARAMS_KEY}.{name}={value!r}: must be an integer >= {minimum}")
    return value


@dataclass(frozen=True)
class ConnectorParams:
    num_prefix_tokens: int
    chunk_token_counts: tuple[int, ...]
    method: str = PLANNED  # "cachesmith": planned under slo_ms; else a fixed method
    slo_ms: float = DEFAULT_SLO_S * 1000.0

    @classmethod
    def parse(cls, raw, num_prompt_tokens: int) -> ConnectorParams:
        """The parameters of a prompt of `num_prompt_tokens` tokens, or an InputError naming the field."""
        if not isinstance(raw, dict):
            raise InputError(f"kv_transfer_params.{PARAMS_KEY} must be an object, not {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise InputError(f"{PARAMS_KEY}.{unknown[0]}: unknown field (known: {', '.join(_FIELDS)})")
        for name in ("num_prefix_tokens", "chunk_token_counts"):
            if name not in raw:
                raise InputError(f"{PARAMS_KEY}.{name} is required")
        counts = raw["chunk_token_counts"]
        if not isinstance(counts, list):
            raise InputError(f"{PARAMS_KEY}.chunk_token_counts must be a list of token counts")
        params = cls(_count(raw["num_prefix_tokens"], "num_prefix_tokens", 0),
                     tuple(_count(n, f"chunk_token_counts[{i}]", 1) for i, n in enumerate(counts)),
                     raw.get("method", PLANNED), raw.get("slo_ms", DEFAULT_SLO_S * 1000.0))
        params._check(num_prompt_tokens)
        return params

    def _check(self, num_prompt_tokens: int) -> None:
        if not isinstance(self.method, str):
            raise InputError(f"{PARAMS_KEY}.method={self.method!r}: must be a string")
        if self.method != PLANNED:
            try:
                parse_method(self.method).plan(1)
            except CachesmithError as exc:
                raise InputError(f"{PARAMS_KEY}.method={self.method!r}: '{PLANNED}' (planned under slo_ms) "
                                 f"or a fixed method: {exc}") from None
        slo = self.slo_ms
        check_slo(slo, f"{PARAMS_KEY}.slo_ms", MAX_SLO_S, scale=1e3)
        framed = self.num_prefix_tokens + sum(self.chunk_token_counts)
        if framed > num_prompt_tokens - 1:  # the question keeps at least the prompt's last token
            raise InputError(f"{PARAMS_KEY}: num_prefix_tokens + sum(chunk_token_counts) = {framed} must leave "
                             f"at least one question token of the prompt's {num_prompt_tokens}")

    @classmethod
    def of(cls, parts: PromptParts, method: str = PLANNED, slo_ms: float | None = None) -> ConnectorParams:
        """The parameters of a prompt laid out as `parts`, checked as the connector checks them."""
        params = cls(len(parts.prefix_ids), tuple(len(c) for c in parts.chunk_ids), method,
                     DEFAULT_SLO_S * 1000.0 if slo_ms is None else slo_ms)
        params._check(len(parts.token_ids))
        return params

    def to_params(self) -> dict:
        """The request's `kv_transfer_params`."""
        return {PARAMS_KEY: {"num_prefix_tokens": self.num_prefix_tokens,
                             "chunk_token_counts": list(self.chunk_token_counts),
                             "method": self.method, "slo_ms": self.slo_ms}}

    def parts(self, token_ids: list[int]) -> PromptParts:
        """The prompt split as the parameters say: prefix, the chunks, the question."""
        start, chunks = self.num_prefix_tokens, []
        for n in self.chunk_token_counts:
            chunks.append(list(token_ids[start:start + n]))
            start += n
        return PromptParts(list(token_ids[:self.num_prefix_tokens]), chunks, list(token_ids[start:]))


@dataclass(frozen=True)
class LoadReport:
    """What building one prompt's KV took; returned to the client in its `kv_transfer_params`."""
    num_chunks: int
    num_chunks_stored: int  # served by the store
    num_chunks_prefilled: int  # missing: prefilled in isolation and stored
    num_stored_tokens: int  # tokens of the chunks the store served
    num_recomputed_tokens: int  # rows the plan recomputed
    plan: str
    budget_ms: float | None  # the planner's budget (planned requests only)

    def to_params(self) -> dict:
        return {PARAMS_KEY: asdict(self)}


class PromptPlan(NamedTuple):
    """The plan one build of a prompt ran; a rebuild of the same request runs it again."""
    config: RecomputeConfig
    budget_ms: float | None  # the planner's budget (planned requests only)


class PromptKV(NamedTuple):
    cache: KVCache  # rows of the whole prompt; the caller releases it
    report: LoadReport
    plan: PromptPlan


def plan_prompt(pipe: RagPipeline, parts: PromptParts, params: ConnectorParams, waited_s: float) -> PromptPlan:
    """The fixed method's plan, or the planner's for what is left of the SLO after `waited_s`."""
    if params.method != PLANNED:
        return PromptPlan(parse_method(params.method).plan(pipe.model.num_layers), None)
    chosen = one_planner(pipe).plan(parts, max(MIN_BUDGET_S, params.slo_ms / 1000.0 - waited_s))
    return PromptPlan(chosen.config, chosen.budget_s * 1000.0)


def prompt_request(pipe: RagPipeline, parts: PromptParts, params: ConnectorParams, namespace: str = "") -> Request:
    """The engine `Request` of one prompt, as the server builds one: the prefix and every chunk
    keyed once in `namespace` (equal text under two cache salts is two entries, and neither reads
    the other's) and stored here (a miss is prefilled), one answer token, the client's SLO."""
    return Request(0, pipe.stored_prompt(parts, namespace), params.slo_ms / 1000.0, max_new_tokens=1)


def build_prompt_kv(pipe: RagPipeline, token_ids: list[int], params: ConnectorParams, waited_s: float = 0.0, *,
                    namespace: str = "", plan: PromptPlan | None = None) -> PromptKV:
    """The prompt's KV: stored chunks of `namespace` read, missing ones prefilled and stored, then
    `plan` (None: `plan_prompt`'s) run by cachesmith's runner. The caller releases the cache."""
    parts = params.parts(token_ids)
    plan = plan or plan_prompt(pipe, parts, params, waited_s)
    request = prompt_request(pipe, parts, params, namespace)
    was_stored = request.prompt.was_stored
    with pipe.transfer.stage([request.prompt], plan.config, [request.max_new_tokens]) as batch:
        out = pipe.runner.run(batch.requests, plan.config, batch)[0]
    report = LoadReport(len(was_stored), sum(was_stored), was_stored.count(False),
                        sum(len(ids) for ids, hit in zip(parts.chunk_ids, was_stored) if hit),
                        int(out.selected.numel()), plan.config.label(), plan.budget_ms)
    return PromptKV(out.cache, report, plan)


def vllm_request(documents: Sequence[str], question: str, model: str = DEFAULT_MODEL, *,
                 served_name: str | None = None, system: str | None = None, max_tokens: int = 64,
                 method: str = PLANNED, slo_ms: float | None = None) -> dict:
    """The body of a vLLM `/v1/completions` request for `documents` and `question`: the prompt as
    `model`'s tokenizer lays it out for cachesmith (token ids), and its layout in
    `kv_transfer_params`, so that no client counts tokens by hand. `model`: a registered name or a
    folder (only its tokenizer is read); `served_name`: vLLM's `--served-model-name` (default:
    `model`)."""
    from cachesmith.model.assets import resolve_model
    from cachesmith.model.tokenizer import Tokenizer

    parts = Tokenizer(resolve_model(model)).rag_prompt_parts(documents, question, system=system)
    params = ConnectorParams.of(parts, method, slo_ms)
    return {"model": served_name or model, "prompt": parts.token_ids, "max_tokens": max_tokens,
            "kv_transfer_params": params.to_params()}
