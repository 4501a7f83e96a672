"""A completion's prompt tokenized once, before anything is stored or priced.

Also a prompt's size in characters (`prompt_size`), for pricing it before it is tokenized.

In: a `CompletionSpec` (documents as texts or stored chunk ids, the question, the system prompt,
earlier turns), its `max_tokens`, the pipeline (tokenizer, model positions) and a lookup of a
stored chunk's token count for the caller. Out: a `PromptFrame`: the frame's token ids around the
documents, each text document's ids (None for a stored chunk) and each document's token count,
checked against the model's positions, naming the client's field at fault.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cachesmith.errors import InputError
from cachesmith.kvstore.keys import validate_key
from cachesmith.pipeline import RagPipeline
from cachesmith.request import check_fits
from cachesmith.scheduler.feasibility import PromptSize
from cachesmith.server.specs import CompletionSpec


@dataclass(frozen=True)
class PromptFrame:
    prefix_ids: list[int]
    document_ids: list[list[int] | None]  # None: a stored chunk named by id
    num_document_tokens: tuple[int, ...]
    suffix_ids: list[int]


def prompt_size(spec: CompletionSpec) -> PromptSize:
    """The prompt's size in characters, before it is tokenized or checked (a field of the wrong
    type counts nothing here and is named by `tokenize_frame`)."""
    def chars(text) -> int:
        return len(text) if isinstance(text, str) else 0
    turns = sum(chars(turn[1]) for turn in spec.history if isinstance(turn, tuple) and len(turn) == 2)
    return PromptSize(tuple(chars(doc.text) for doc in spec.documents),
                      chars(spec.question) + chars(spec.system) + chars(spec.answer_prefix) + turns)


def tokenize_frame(spec: CompletionSpec, max_tokens: int, pipeline: RagPipeline,
                   stored_tokens: Callable[[str, str], int]) -> PromptFrame:
    """`stored_tokens(chunk_id, field)`: the token count of a stored chunk the caller may read
    (raising `UnknownChunk` naming `field` otherwise)."""
    document_ids: list[list[int] | None] = []
    counts = []
    for i, doc in enumerate(spec.documents):
        if (doc.text is None) == (doc.chunk_id is None):
            raise InputError(f"documents[{i}]: give a text or a chunk id, exactly one")
        if doc.chunk_id is not None:
            validate_key(doc.chunk_id, field=f"documents[{i}].id")
            counts.append(stored_tokens(doc.chunk_id, f"documents[{i}].id"))
            document_ids.append(None)
            continue
        if not doc.text.strip():
            raise InputError(f"documents[{i}]: text must not be empty")
        document_ids.append(pipeline.tokenizer.chunk_ids(doc.text, field=f"documents[{i}]"))
        counts.append(len(document_ids[-1]))
    limit = pipeline.model.config.max_positions
    prefix_ids, suffix_ids = pipeline.tokenizer.frame_ids(spec.question, spec.system or pipeline.system,
                                                          spec.answer_prefix, spec.history)
    num_frame = len(prefix_ids) + len(suffix_ids)
    # the documents are at fault only where the rest of the prompt fits without them
    is_rest_long = num_frame + max_tokens > limit
    check_fits(num_frame + sum(counts), max_tokens, limit,
               "documents" if spec.documents and not is_rest_long else spec.text_field, "max_tokens")
    return PromptFrame(prefix_ids, document_ids, tuple(counts), suffix_ids)
