"""The task registry: each task's generator, its named variants (knob presets) and its default
variant for the packaged model; MIX draws equally from the four tasks.

In: task name, variant, seed, knob overrides. Out: `WorkloadInstance`s, validated: an unknown task,
variant or knob, or an impossible knob value, raises `WorkloadError` naming it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from cachesmith.errors import InputError
from cachesmith.workloads.corpus import Corpus, load_corpus
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.multihop import multi_hop
from cachesmith.workloads.passage_retrieval import passage_retrieval
from cachesmith.workloads.ruler import multi_value, split_assignments, variable_tracking


class WorkloadError(InputError):
    """An unknown task, variant or knob, or a knob value the generator cannot honour."""


@dataclass(frozen=True)
class Variant:
    generator: Callable[..., WorkloadInstance]
    knobs: dict = field(default_factory=dict)  # preset knob values, overridable per call

    def allowed_knobs(self) -> dict[str, object]:
        params = inspect.signature(self.generator).parameters
        return {n: p.default for n, p in params.items() if n not in ("corpus", "seed", "variant")}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    variants: dict[str, Variant]
    default_variant: str  # the calibrated choice for the packaged model (docs/cards)
    paper_variant: str  # the form the paper evaluates
    description: str = ""


# Defaults are the variants the packaged SmolLM2-135M can do (docs/cards); the paper's forms stay
# available by name (`paper_variant`) for larger models.
TASKS: dict[str, TaskSpec] = {
    "pr": TaskSpec("pr", {
        "description": Variant(passage_retrieval),
        "title": Variant(passage_retrieval, {"num_chunks": 4}),
    }, "title", "description", "passage retrieval: which numbered paragraph matches the question"),
    "msq": TaskSpec("msq", {
        "2hop": Variant(multi_hop, {"num_hops": 2}), "3hop": Variant(multi_hop, {"num_hops": 3}),
        "4hop": Variant(multi_hop, {"num_hops": 4}), "1hop": Variant(multi_hop, {"num_hops": 1, "num_distractors": 2}),
    }, "1hop", "2hop", "multi-hop QA over facts spread across chunks"),
    "vt": TaskSpec("vt", {
        "4hop": Variant(variable_tracking, {"num_hops": 4}), "1hop": Variant(variable_tracking, {"num_hops": 1}),
        "kv-split": Variant(split_assignments),
    }, "kv-split", "4hop", "RULER variable tracking: every variable in an assignment chain"),
    "mv": TaskSpec("mv", {
        "default": Variant(multi_value, {"num_distractors": 2}),
        "1-distractor": Variant(multi_value, {"num_distractors": 1}),
    }, "1-distractor", "default", "RULER multi-value needle: every value of one key"),
}
MIX_TASKS = ("pr", "msq", "vt", "mv")


def _check_knobs(spec: TaskSpec, variant: Variant, knobs: dict) -> None:
    allowed = variant.allowed_knobs()
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise WorkloadError(f"task {spec.name!r}: unknown knob(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(allowed))}")
    merged = {**allowed, **knobs}
    for name, value in merged.items():
        if isinstance(allowed[name], int) and (not isinstance(value, int) or isinstance(value, bool)):
            raise WorkloadError(f"task {spec.name!r}: knob {name} must be an integer, got {value!r}")
    chunks = merged.get("num_chunks", 1)
    if chunks < 1:
        raise WorkloadError(f"task {spec.name!r}: num_chunks must be >= 1, got {chunks}")
    for knob, needed in (("num_values", merged.get("num_values")), ("num_keys", merged.get("num_keys", 0) + 1),
                         ("num_hops", (merged.get("num_hops") or 0) + (spec.name == "vt"))):
        if needed is not None and needed > chunks:
            raise WorkloadError(f"task {spec.name!r}: {knob}={merged[knob]} needs {needed} distinct "
                                f"chunks but num_chunks={chunks}")
    for name, value in merged.items():
        if name in ("num_hops", "num_values", "num_keys", "chunk_tokens", "min_words", "max_words") and value < 1:
            raise WorkloadError(f"task {spec.name!r}: {name} must be >= 1, got {value}")
        if name in ("num_distractors", "num_chains") and value < (1 if name == "num_chains" else 0):
            raise WorkloadError(f"task {spec.name!r}: {name}={value} is out of range")


def resolve(task: str, variant: str | None = None) -> tuple[TaskSpec, str, Variant]:
    if task not in TASKS:
        raise WorkloadError(f"unknown task {task!r}; known: {', '.join(TASKS)}, mix")
    spec = TASKS[task]
    variant = variant or spec.default_variant
    if variant not in spec.variants:
        raise WorkloadError(f"task {task!r}: unknown variant {variant!r}; known: {', '.join(spec.variants)}")
    return spec, variant, spec.variants[variant]


def generate(task: str, seed: int, variant: str | None = None, corpus: Corpus | None = None,
             **knobs) -> WorkloadInstance:
    """One instance, deterministic in (task, variant, seed, knobs, corpus)."""
    if task == "mix":
        if variant not in (None, "default"):
            raise WorkloadError(f"task 'mix' has no variant {variant!r}; it uses each task's default")
        if knobs:
            raise WorkloadError(f"task 'mix' takes no knobs (got {', '.join(sorted(knobs))}); "
                                f"each task runs at its default variant")
        # consecutive seeds cycle through the tasks: any run of 4k seeds is an exactly equal draw
        return generate(MIX_TASKS[seed % len(MIX_TASKS)], seed, None, corpus)
    spec, name, variant_spec = resolve(task, variant)
    merged = {**variant_spec.knobs, **knobs}
    _check_knobs(spec, variant_spec, merged)
    # every generator takes the variant's name and reports it on the instance
    return variant_spec.generator(corpus or load_corpus(), seed, variant=name, **merged)


def generate_many(task: str, num_instances: int, seed: int = 0, variant: str | None = None,
                  corpus: Corpus | None = None, **knobs) -> list[WorkloadInstance]:
    if num_instances < 1:
        raise WorkloadError(f"num_instances must be >= 1, got {num_instances}")
    return [generate(task, seed + i, variant, corpus, **knobs) for i in range(num_instances)]
