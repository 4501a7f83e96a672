"""A benchmark's or workload file's request as the profiler measures it.

In: a `WorkloadInstance` and the pipeline that renders and tokenizes its prompt. Out: a
`calibration.subjects.Subject` of token ids (its chunks are prefilled and stored on first use),
keyed by the instance's content hash, so a changed generator never reuses verdicts cached for the
old text.
"""
from __future__ import annotations

from cachesmith.calibration.subjects import Subject
from cachesmith.instance import WorkloadInstance
from cachesmith.pipeline import RagPipeline
from cachesmith.scoring import Expected
from cachesmith.workloads.card import instance_digest
from cachesmith.workloads.prompts import instance_prompt


def instance_subject(pipe: RagPipeline, inst: WorkloadInstance) -> Subject:
    return Subject(instance_digest(inst), Expected.of(inst), inst.max_new_tokens, instance_prompt(pipe, inst))
