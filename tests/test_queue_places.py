"""`AdmissionTurns`: granted in the order asked, reentrant, and never stuck on a waiter that left."""
import threading
import time

import pytest

from cachesmith.queue_places import AdmissionTurns


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def _queue_waiters(turns: AdmissionTurns, names: list[str], order: list[str]) -> list[threading.Thread]:
    """Start one thread per name, each asking for a turn only once the previous one is waiting."""
    threads = []
    for name in names:
        def work(name=name):
            with turns:
                order.append(name)
        thread = threading.Thread(target=work)
        asked = turns._next_ticket
        thread.start()
        _wait_until(lambda: turns._next_ticket == asked + 1)  # it holds its ticket now
        threads.append(thread)
    return threads


def test_turns_are_granted_in_the_order_they_were_asked_for():
    turns, order = AdmissionTurns(), []
    with turns:  # held, so every waiter queues behind it
        threads = _queue_waiters(turns, [f"w{i}" for i in range(8)], order)
        assert order == []
    for thread in threads:
        thread.join(5)
    assert order == [f"w{i}" for i in range(8)]


def test_the_holder_takes_its_turn_again_without_waiting_behind_anyone():
    turns, order = AdmissionTurns(), []
    with turns:
        threads = _queue_waiters(turns, ["later"], order)
        with turns:  # the store call inside an admission's turn takes it again
            order.append("inner")
        assert order == ["inner"]
    threads[0].join(5)
    assert order == ["inner", "later"]


def test_a_waiter_that_gives_up_does_not_stall_those_behind_it():
    turns, order = AdmissionTurns(), []
    turns.__enter__()
    turns._abandoned.add(turns._next_ticket)  # as a waiter interrupted before its turn leaves it
    turns._next_ticket += 1
    threads = _queue_waiters(turns, ["after"], order)
    turns.__exit__(None, None, None)
    threads[0].join(5)
    assert order == ["after"]
    assert not turns._abandoned


def test_only_the_holder_can_end_its_turn():
    turns = AdmissionTurns()
    with turns:
        errors = []

        def intruder():
            try:
                turns.__exit__(None, None, None)
            except RuntimeError as exc:
                errors.append(str(exc))
        thread = threading.Thread(target=intruder)
        thread.start()
        thread.join(5)
    assert errors and "does not hold it" in errors[0]
    with pytest.raises(RuntimeError, match="does not hold it"):
        turns.__exit__(None, None, None)
