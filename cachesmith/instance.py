"""A workload instance: a prefix (instruction), documents (one passage per chunk), a question (the
suffix), gold answers and metadata; with its JSON line form, the format `cachesmith bench
--workload FILE.jsonl` reads (docs/workloads.md, "Workload files").
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachesmith.errors import InputError

_REQUIRED = ("question",)  # gold is optional: the fidelity gate needs none


@dataclass(frozen=True)
class WorkloadInstance:
    task: str
    documents: tuple[str, ...]
    question: str
    gold: tuple[str, ...]  # () for a served request that brings none: it is not gated
    variant: str = "default"
    prefix: str = ""  # system instruction before the documents; "" keeps the model's default
    answer_prefix: str = ""  # opens the assistant turn, so a short greedy decode suffices
    max_new_tokens: int = 16
    metadata: dict[str, Any] = field(default_factory=dict)
    chunk_ids: tuple[str, ...] = ()  # chunks already in the store (`cachesmith precompute --keys-out`)
    history: tuple[tuple[str, str], ...] = ()  # earlier (role, content) chat turns, before the documents

    def __post_init__(self) -> None:
        if self.documents and self.chunk_ids:  # neither: a plain chat, its whole prompt computed
            raise InputError(f"{self.task}: give the chunks as documents (texts) or as chunk_ids "
                             f"(stored chunk ids), not both")
        if self.max_new_tokens < 1:
            raise InputError(f"{self.task}: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def name(self) -> str:
        return f"{self.task}/{self.variant}/{self.metadata.get('seed', '?')}"

    def to_json(self) -> str:
        fields = asdict(self)
        if not fields["history"]:  # single-turn lines stay as they were (their content digests too)
            del fields["history"]
        return json.dumps(fields, ensure_ascii=False)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "instance") -> "WorkloadInstance":
        if not isinstance(raw, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise InputError(f"{where}: missing field(s) {', '.join(missing)}")
        docs, gold, ids = raw.get("documents", []), raw.get("gold", []), raw.get("chunk_ids", [])
        if not isinstance(docs, list) or not all(isinstance(d, str) and d.strip() for d in docs):
            raise InputError(f"{where}: documents must be a list of non-empty strings")
        if not isinstance(ids, list) or not all(isinstance(k, str) and k for k in ids):
            raise InputError(f"{where}: chunk_ids must be a list of stored chunk ids (strings)")
        if bool(docs) == bool(ids):
            raise InputError(f"{where}: needs documents (texts) or chunk_ids (stored chunk ids), exactly one, "
                             f"with at least one chunk")
        if isinstance(gold, str):
            gold = [gold]
        if "gold" in raw and (not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold)):
            raise InputError(f"{where}: gold must be a string or a non-empty list of strings (or left out)")
        if not isinstance(raw["question"], str) or not raw["question"].strip():
            raise InputError(f"{where}: question must be a non-empty string")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}")
        history = raw.get("history", [])
        if not isinstance(history, list) or not all(
                isinstance(t, list) and len(t) == 2 and t[0] in ("user", "assistant") and isinstance(t[1], str)
                for t in history):
            raise InputError(f"{where}: history must be a list of [role, content] turns (role user or assistant)")
        return cls(**{**raw, "documents": tuple(docs), "gold": tuple(gold), "chunk_ids": tuple(ids),
                      "task": raw.get("task", "custom"), "history": tuple(tuple(t) for t in history)})


def load_workload_file(path: str) -> list[WorkloadInstance | str]:
    """Instances of a JSONL workload file; a bad line becomes its error message (kept in place)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"workload file {path}: cannot be read ({exc})") from exc
    out: list[WorkloadInstance | str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(WorkloadInstance.from_dict(json.loads(line), where=f"{path} line {n}"))
        except json.JSONDecodeError as exc:
            out.append(f"{path} line {n}: not JSON ({exc.msg})")
        except InputError as exc:
            out.append(str(exc))
    if not out:
        raise InputError(f"workload file {path}: no requests")
    return out
