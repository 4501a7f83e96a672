"""Quality gates: task metric vs agreement with the full-prefill answer, selectable by name."""
from __future__ import annotations

import pytest

from cachesmith.errors import InputError
from cachesmith.gates import FidelityGate, TaskGate, make_gate
from cachesmith.instance import WorkloadInstance


def case(task="msq", gold=("Port Lantern",)):
    return WorkloadInstance(task=task, documents=("d",), question="q?", gold=gold)


def test_task_gate_follows_the_gold():
    gate = make_gate("task")
    assert isinstance(gate, TaskGate) and not gate.needs_reference
    assert gate.passes(case(), "Port Lantern.") and not gate.passes(case(), "Amberfield")


def test_fidelity_gate_follows_the_full_prefill_answer():
    gate = make_gate("fidelity")
    assert isinstance(gate, FidelityGate) and gate.needs_reference
    # both wrong but equal: fidelity passes where the task gate fails
    assert gate.passes(case(), "Amberfield, a town", reference="amberfield.")
    assert not gate.passes(case(), "Port Lantern", reference="Amberfield")
    mv = case("mv", ("1111111", "2222222"))
    assert gate.passes(mv, "2222222 and 1111111", reference="1111111, 2222222")
    assert not gate.passes(mv, "1111111", reference="1111111, 2222222")


def test_fidelity_without_reference_and_unknown_gate_are_named():
    with pytest.raises(InputError, match="full-prefill answer"):
        make_gate("fidelity").passes(case(), "x")
    with pytest.raises(InputError, match="gate='strict'"):
        make_gate("strict")
