"""What the profiler measures a plan on: a workload instance (offline profiles, outcome tables) or a
served engine `Request` (idle-time shadow work on the served mix).

In: either. Out: its digest (the verdict cache's key), what its answers are scored against, its
answer length, and its prompt as a `RecomputeRequest` over stored chunk KV. An instance's prompt is
rendered and tokenized here; a served request's entries are read by the keys it was served with,
in its caller's namespace, so shadow work never copies a tenant's chunks into another namespace.
"""
from __future__ import annotations

import hashlib
import json

from cachesmith.errors import InputError
from cachesmith.instance import WorkloadInstance
from cachesmith.model import ChunkKV
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import RecomputeRequest
from cachesmith.kvstore import StoredEntry
from cachesmith.request import Request
from cachesmith.scoring import Scored
from cachesmith.workloads.card import instance_digest
from cachesmith.workloads.prompts import instance_prompt

Subject = WorkloadInstance | Request


def digest(subject: Subject) -> str:
    """A content hash: equal prompts (and answer lengths) share their cached verdicts."""
    if isinstance(subject, WorkloadInstance):
        return instance_digest(subject)
    p = subject.prompt
    text = json.dumps([p.prefix_key, list(p.chunk_keys), list(p.suffix_ids), subject.max_new_tokens,
                       subject.expected.task, list(subject.expected.gold)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scored(subject: Subject) -> Scored:
    return subject if isinstance(subject, WorkloadInstance) else subject.expected


def recompute_request(pipe: RagPipeline, subject: Subject, max_new_tokens: int) -> RecomputeRequest:
    """The subject's prompt over its stored chunk KV (an instance's missing chunks are prefilled
    and stored), with room for `max_new_tokens`."""
    if isinstance(subject, WorkloadInstance):
        parts = instance_prompt(pipe, subject)
        return RecomputeRequest([pipe.chunk(ids) for ids in parts.chunk_ids], parts.suffix_ids,
                                pipe.chunk(parts.prefix_ids) if parts.prefix_ids else None,
                                extra_capacity=max_new_tokens)
    prompt = subject.prompt
    if prompt is None:
        raise InputError(f"request {subject.request_id}: a simulated request has no prompt to measure")
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
