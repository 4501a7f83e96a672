"""Quality gates: whether one answer counts as good for QSA. Selectable per run by name.

- `task`: the task's own metric passes (EM, paragraph number, set F1 > 0.5, ...).
- `fidelity`: the answer agrees with the full-prefill answer to the same prompt (the canonical
  extracted answers are equal), whatever the gold says: "did reuse change the answer?".
In: what the answer is scored against (`scoring.Scored`), the answer text and, for fidelity,
the full-prefill answer text. Out: a bool.
The serving engine gates every answer and the profiler judges its verdicts with these, so they sit
low, beside `scoring` (docs/layout.md).
"""
from __future__ import annotations

from typing import Protocol

from cachesmith.errors import InputError
from cachesmith.scoring import Scored, score


class QualityGate(Protocol):
    name: str
    needs_reference: bool

    def passes(self, inst: Scored, answer: str, reference: str | None = None) -> bool: ...


class TaskGate:
    name = "task"
    needs_reference = False

    def passes(self, inst: Scored, answer: str, reference: str | None = None) -> bool:
        return score(inst, answer).passed


class FidelityGate:
    name = "fidelity"
    needs_reference = True

    def passes(self, inst: Scored, answer: str, reference: str | None = None) -> bool:
        if reference is None:
            raise InputError(f"{inst.task}: the fidelity gate needs the full-prefill answer (reference)")
        return score(inst, answer).extracted == score(inst, reference).extracted


GATES: dict[str, type] = {"task": TaskGate, "fidelity": FidelityGate}


def make_gate(name: str) -> QualityGate:
    if name not in GATES:
        raise InputError(f"gate={name!r}: must be one of {', '.join(GATES)}")
    return GATES[name]()
