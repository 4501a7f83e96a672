"""What a plan's answer is measured on: a `Subject`, plain data whichever request it came from.

In: a served engine `Request` (`served_subject`: idle-time shadow work on the served mix) or, built
offline by `profiler.subjects`, a benchmark's or workload file's request. Out: a `Subject` (its
digest, the verdict cache's key; what its answers are scored against; its answer length; its
prompt) and that prompt as a `RecomputeRequest` over stored chunk KV (`recompute_request`). A
served prompt's entries are read by the keys it was served with, in its caller's namespace, so
shadow work never copies a tenant's chunks into another namespace; a prompt given as token ids
(`PromptParts`) has its chunks prefilled and stored in the default namespace on a miss.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from cachesmith.errors import InputError
from cachesmith.kvstore import StoredEntry, StoredPrompt
from cachesmith.model import ChunkKV
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import RecomputeRequest
from cachesmith.request import Request
from cachesmith.scoring import Expected


@dataclass(frozen=True)
class Subject:
    digest: str  # a content hash: equal prompts (and answer lengths) share their cached verdicts
    expected: Expected
    max_new_tokens: int
    prompt: StoredPrompt | PromptParts  # stored entries by key, or token ids to store

    @property
    def task(self) -> str:
        return self.expected.task


def served_subject(request: Request) -> Subject:
    """A served request as the profiler measures it (a simulated request, with no prompt, cannot be)."""
    p = request.prompt
    if p is None:
        raise InputError(f"request {request.request_id}: a simulated request has no prompt to measure")
    text = json.dumps([p.prefix_key, list(p.chunk_keys), list(p.suffix_ids), request.max_new_tokens,
                       request.expected.task, list(request.expected.gold)])
    return Subject(hashlib.sha256(text.encode()).hexdigest()[:16], request.expected, request.max_new_tokens, p)


def recompute_request(pipe: RagPipeline, subject: Subject, max_new_tokens: int) -> RecomputeRequest:
    """The subject's prompt over its stored chunk KV (missing chunks are prefilled and stored), with
    room for `max_new_tokens`."""
    prompt = subject.prompt
    if isinstance(prompt, PromptParts):
        return RecomputeRequest([pipe.chunk(ids) for ids in prompt.chunk_ids], prompt.suffix_ids,
                                pipe.chunk(prompt.prefix_ids) if prompt.prefix_ids else None,
                                extra_capacity=max_new_tokens)
    chunks = [_entry(pipe, entry) for entry in prompt.chunks]
    prefix = _entry(pipe, prompt.prefix) if prompt.prefix is not None else None
    return RecomputeRequest(chunks, list(prompt.suffix_ids), prefix, extra_capacity=max_new_tokens)


def _entry(pipe: RagPipeline, entry: StoredEntry) -> ChunkKV:
    """A served entry by its key; one evicted since is prefilled again where its caller stored it."""
    key = entry.key
    chunk = pipe.store.get(key, pipe.model)
    if chunk is None:
        if entry.token_ids is None:
            raise InputError(f"entry {key[:12]} is no longer stored and was not stored by this request")
        pipe.store.ensure(pipe.model, entry.token_ids, entry.namespace, key)
        chunk = pipe.store.get(key, pipe.model)
        if chunk is None:
            raise InputError(f"entry {key[:12]} could not be stored again")
    return chunk
