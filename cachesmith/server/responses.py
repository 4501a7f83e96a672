"""Response bodies in OpenAI's shapes (text completion and chat completion, whole or as SSE chunks),
with a `cachesmith` object per response telling how the request was served.

In: a finished `RequestResult` (or a `TokenStream` for streaming). Out: JSON-ready dicts, or the
`data: ...` lines of an SSE stream ending with `data: [DONE]`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from cachesmith.request import RequestResult
from cachesmith.server.logprobs import chat_logprobs, num_answer_tokens, text_logprobs
from cachesmith.server.streaming import TokenStream, answer_text, finish_reason
from cachesmith.shedding import SHED_KIND


@dataclass(frozen=True)
class _ShapeInfo:
    id_prefix: str
    object: str
    chunk_object: str


class Shape(Enum):
    COMPLETION = _ShapeInfo("cmpl", "text_completion", "text_completion")
    CHAT = _ShapeInfo("chatcmpl", "chat.completion", "chat.completion.chunk")

    @property
    def id_prefix(self) -> str:
        return self.value.id_prefix


def served(result: RequestResult) -> dict:
    """What cachesmith did for this request (times in ms on the server's clock). `cached_tokens`
    splits usage's cached tokens: the exact prompt prefix read from the store, and context rows
    composed from stored chunk KV and not recomputed."""
    return {"ttft_ms": round(1e3 * result.ttft_s, 3), "slo_ms": round(1e3 * result.slo_s, 3),
            "is_on_time": result.is_on_time, "is_passed": result.is_passed, "mode": result.mode,
            "plan": result.plan, "coverage": result.coverage, "num_context_tokens": result.num_context_tokens,
            "num_recomputed": result.num_recomputed, "batch_size": result.batch_size,
            "cached_tokens": {"prefix": result.num_cached_prefix, "chunks": sum(result.reused_by_chunk)}}


def usage(result: RequestResult) -> dict:
    return {"prompt_tokens": result.num_prompt_tokens, "completion_tokens": result.num_output_tokens,
            "total_tokens": result.num_prompt_tokens + result.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens}}


def completion_body(shape: Shape, head: dict, result: RequestResult, max_tokens: int,
                    stop: Sequence[str], token_text: Callable[[int], str] | None = None) -> dict:
    text, _ = answer_text(result, stop)
    reason = finish_reason(result, max_tokens, stop)
    logprobs = _logprobs(shape, result, text, token_text)
    if shape is Shape.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return {**head, "object": shape.value.object, "choices": [choice], "usage": usage(result),
            "cachesmith": served(result)}


def _logprobs(shape: Shape, result: RequestResult, text: str, token_text: Callable[[int], str] | None) -> dict | None:
    """The log-probabilities of the tokens `text` spans, when the request asked for them."""
    if result.logprobs is None or token_text is None:
        return None
    records = result.logprobs[:num_answer_tokens(result, text, token_text)]
    return chat_logprobs(records, token_text) if shape is Shape.CHAT else text_logprobs(records, token_text)


def _chunk(shape: Shape, head: dict, text: str | None, reason: str | None, role: bool = False) -> dict:
    if shape is Shape.CHAT:
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {**head, "object": shape.value.chunk_object, "choices": [choice]}


def _event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse(shape: Shape, head: dict, stream: TokenStream, max_tokens: int, include_usage: bool,
              token_text: Callable[[int], str] | None = None) -> AsyncIterator[str]:
    """The chunks of a streamed answer. Asked-for log-probabilities come with the final chunk, all
    of them (the engine hands them over when the request ends): the streamed lists, joined, equal
    the non-streamed response's."""
    is_first = True
    async for piece in stream.deltas():
        yield _event(_chunk(shape, head, piece, None, role=is_first))
        is_first = False
    result = stream.result
    if result.error is not None:  # failed after the response started: say so in-band
        kind = "server_error" if result.is_internal_error else "invalid_request_error"
        code = result.error_kind if result.error_kind == SHED_KIND else None
        kind = "rate_limit_error" if code else kind
        yield _event({"error": {"message": result.error, "type": kind, "param": None, "code": code}})
        yield _event("[DONE]")
        return
    final = _chunk(shape, head, "" if is_first else None, finish_reason(result, max_tokens, stream.stop),
                   role=is_first)
    final["choices"][0]["logprobs"] = _logprobs(shape, result, answer_text(result, stream.stop)[0], token_text)
    final["cachesmith"] = served(result)
    yield _event(final)
    if include_usage:
        yield _event({**head, "object": shape.value.chunk_object, "choices": [], "usage": usage(result)})
    yield _event("[DONE]")
