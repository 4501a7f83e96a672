"""Log-probabilities in OpenAI's two shapes.

In: the `TokenLogprob` records of a request's generated tokens and a function giving a token's text.
Out: chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}`
or the legacy completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`. Only the
tokens that make up the returned text are listed (a stop string cuts the rest off, as it cuts the
text).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from cachesmith.model.sampling import TokenLogprob
from cachesmith.request import RequestResult

TokenText = Callable[[int], str]


def _entry(token_id: int, logprob: float, token_text: TokenText) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(records: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    content = []
    for r in records:
        entry = _entry(r.token_id, r.logprob, token_text)
        entry["top_logprobs"] = [_entry(t, lp, token_text) for t, lp in r.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def text_logprobs(records: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    tokens = [token_text(r.token_id) for r in records]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = [{token_text(t): lp for t, lp in r.top} for r in records]
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": top if any(r.top for r in records) else None, "text_offset": offsets}


def num_answer_tokens(result: RequestResult, text: str, token_text: TokenText) -> int:
    """How many generated tokens the returned `text` spans (all, unless a stop string cut it)."""
    ids = result.output_token_ids
    if len(text) >= len(result.answer):
        return len(ids)
    joined = ""
    for k, token_id in enumerate(ids, start=1):
        joined += token_text(token_id)
        if len(joined.strip()) >= len(text):
            return k
    return len(ids)
