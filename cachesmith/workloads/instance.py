"""A workload instance: documents (one per chunk), a question, gold answers and metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadInstance:
    task: str
    documents: tuple[str, ...]
    question: str
    gold: tuple[str, ...]
    answer_prefix: str = ""  # opens the assistant turn, so a short greedy decode suffices
    metadata: dict = field(default_factory=dict)

    def is_correct(self, answer: str) -> bool:
        return any(g in answer for g in self.gold)
