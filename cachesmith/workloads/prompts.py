"""A workload instance's prompt on a pipeline: the texts an instance holds, rendered in the model's
chat template and tokenized, with chunks it names by stored id read from the store.

In: a `RagPipeline` and a `WorkloadInstance`. Out: its `PromptParts` (prefix, chunk and suffix
token ids). Benchmarks and the profiler call this; a served request arrives already keyed, so the
serving engine never does.
"""
from __future__ import annotations

from cachesmith.errors import InputError
from cachesmith.instance import WorkloadInstance
from cachesmith.model.tokenizer import PromptParts
from cachesmith.pipeline import RagPipeline


def instance_prompt(pipe: RagPipeline, inst: WorkloadInstance) -> PromptParts:
    """An instance's prompt; chunks given as stored chunk ids take their tokens from the store."""
    system = inst.prefix or None
    if not inst.chunk_ids:
        return pipe.prompt(inst.documents, inst.question, inst.answer_prefix, system, inst.history)
    chunks = []
    for i, key in enumerate(inst.chunk_ids):
        try:
            reader = pipe.store.open(key, pipe.model)
        except ValueError as exc:  # a malformed key
            raise InputError(f"chunk_ids[{i}]={key!r}: {exc}") from None
        if reader is None:
            raise InputError(f"chunk_ids[{i}]={key!r}: unknown chunk id (not in the store; "
                             f"`cachesmith precompute --keys-out` lists stored ids)")
        chunks.append(list(reader.header.token_ids))
        reader.close()
    parts = pipe.prompt(["-"], inst.question, inst.answer_prefix, system, inst.history)
    return PromptParts(parts.prefix_ids, chunks, parts.suffix_ids)
