"""Chat history at a cost linear in its turns: the earlier turns' prefixes from one marked rendering
(the same ones `Tokenizer.earlier_prefixes` renders turn by turn), and a bounded queue of turns to
store that a later turn never waits behind."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from cachesmith.engine import EngineConfig
from cachesmith.model.tokenizer import Tokenizer
from cachesmith.server import CompletionSpec
from cachesmith.server.jobs import BackgroundJobs
from cachesmith.server.metrics import ServiceMetrics
from cachesmith.server.turns import MAX_EXACT_TURNS, turn_prefixes
from tests.engine_helpers import save_tiny_chat_model
from tests.server.conftest import NAME, make_service

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

TEXTS = ["Hi", " spaced ", "\nstarts on a new line", "émoji 😀", "a\n\nb", "user", "<b>x</b>", "   ", "42"]


def conversation(num_turns: int, offset: int = 0) -> tuple[tuple[str, str], ...]:
    return tuple((("user", "assistant")[i % 2], TEXTS[(i + offset) % len(TEXTS)]) for i in range(num_turns))


def turn_by_turn(tokenizer: Tokenizer, system, turns, is_head: bool):
    """The prefixes as rendered one turn at a time, kept where they are proper prefixes of the ids."""
    ids = tokenizer.prefix_ids(system, turns) if is_head else tokenizer.conversation_ids(system, turns)
    found = {tuple(p) for p in tokenizer.earlier_prefixes(system, turns) if 0 < len(p) < len(ids) and ids[:len(p)] == p}
    return ids, sorted(found, key=len, reverse=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return Tokenizer(tiny_chat_dir)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_the_marked_rendering_finds_every_prefix_the_turn_by_turn_one_does(tokenizer, system):
    for num_turns in range(1, 9):
        for offset in range(len(TEXTS)):
            turns = conversation(num_turns, offset)
            for is_head in (True, False) if num_turns % 2 == 0 else (True,):
                ids, earlier = turn_prefixes(tokenizer, system, turns, is_head)
                want_ids, want = turn_by_turn(tokenizer, system, turns, is_head)
                assert ids == want_ids and [tuple(p) for p in earlier] == want, (turns, is_head)


def test_a_template_that_trims_falls_back_to_the_latest_turns(tokenizer, monkeypatch):
    trimming = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    monkeypatch.setattr(tokenizer.hf, "chat_template", trimming)
    turns = conversation(12, offset=1)  # " spaced " is trimmed: the marked rendering cannot locate it
    ids, earlier = turn_prefixes(tokenizer, None, turns)
    _, want = turn_by_turn(tokenizer, None, turns, True)
    got = [tuple(p) for p in earlier]
    assert got and set(got) <= set(want) and got[0] == want[0]  # the longest, the previous exchange, is found
    assert len(got) <= 2 * MAX_EXACT_TURNS < len(want)


def chat_cost(service, num_turns: int, monkeypatch) -> dict[str, int]:
    """Characters tokenized and messages rendered to serve one chat turn after `num_turns` turns
    nothing stored yet, and to store its exchange."""
    tokenizer, counts = service.pipeline.tokenizer, {"chars": 0, "messages": 0}
    encode, chat_text = Tokenizer.encode, Tokenizer.chat_text

    def spy_encode(text, *args, **kwargs):
        counts["chars"] += len(text)
        return encode(tokenizer, text, *args, **kwargs)

    def spy_chat_text(messages, *args, **kwargs):
        counts["messages"] += len(messages)
        return chat_text(tokenizer, messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy_encode)
    monkeypatch.setattr(tokenizer, "chat_text", spy_chat_text)
    turns = tuple((("user", "assistant")[i % 2], f"t{i}.{num_turns}") for i in range(num_turns))
    spec = CompletionSpec((), "and now?", max_tokens=1, history=turns, is_chat=True)
    assert service.submit(spec).result(timeout=60).error is None
    deadline = time.monotonic() + 30
    while service._turn_stores.num_pending and time.monotonic() < deadline:  # its exchange, stored off the path
        time.sleep(0.01)
    monkeypatch.undo()
    return counts


def test_a_turn_costs_time_linear_in_the_conversation(tmp_path, monkeypatch):
    model_dir = save_tiny_chat_model(tmp_path / "tiny-4k", num_layers=2, max_positions=4096)  # 100 turns fit
    service = make_service(model_dir, engine=EngineConfig("full_prefill", "live"))
    try:
        short, long = chat_cost(service, 10, monkeypatch), chat_cost(service, 100, monkeypatch)
    finally:
        service.close(30)
    # rendered and tokenized again for each earlier turn, 10x the turns would cost ~50x (quadratic)
    assert long["chars"] <= 12 * short["chars"] and long["messages"] <= 12 * short["messages"], (short, long)
    assert long["messages"] <= 10 * 100, long


def test_a_queued_job_runs_for_the_turn_that_needs_it_and_a_full_queue_drops(tmp_path):
    jobs = BackgroundJobs("test-jobs", max_pending=2)
    gate, started, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        gate.wait(10)
        ran.append(("slow", threading.current_thread().name))

    assert jobs.submit("slow", slow)
    assert started.wait(10)
    assert jobs.submit("mine", lambda: ran.append(("mine", threading.current_thread().name)))
    assert not jobs.submit("dropped", lambda: ran.append(("dropped", "")))  # two waiting: full
    jobs.take_over("mine")  # behind the slow one in the queue: runs here, now
    assert ran == [("mine", threading.current_thread().name)]
    gate.set()
    jobs.take_over("slow")  # running: waited for
    assert [name for name, _ in ran] == ["mine", "slow"] and jobs.num_pending == 0
    jobs.close()


def test_a_turn_past_a_full_store_queue_is_answered_unstored_and_counted(tiny_chat_dir, caplog):
    service = make_service(tiny_chat_dir, engine=EngineConfig("full_prefill", "live"))
    metrics = ServiceMetrics(service)
    service._turn_stores.max_pending = 0  # as if 64 exchanges were waiting
    try:
        with caplog.at_level(logging.WARNING, logger="cachesmith.server.service"):
            for i in range(3):
                spec = CompletionSpec((), f"Question {i}?", max_tokens=2, is_chat=True)
                assert service.submit(spec).result(timeout=60).error is None
            deadline = time.monotonic() + 10
            while service.num_turn_stores_dropped < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert service.num_turn_stores_dropped == 3
        assert len([r for r in caplog.records if "answered without storing" in r.getMessage()]) == 1
        text = metrics.exposition().decode()
        assert f'cachesmith:turn_stores_dropped_total{{model_name="{NAME}"}} 3.0' in text
    finally:
        service.close(30)
