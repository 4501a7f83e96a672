"""The live engine loop: concurrent submits, refusals, queue limit, drain on close, failed batches."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from cachesmith.clock import LiveClock
from cachesmith.engine import Engine, EngineConfig
from cachesmith.engine_loop import EngineLoop
from cachesmith.queue_places import EngineClosed, QueueFull, RequestFuture
from cachesmith.errors import ConfigError, InputError
from cachesmith.instance import WorkloadInstance
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.request import Request, check_fits, check_slo
from cachesmith.calibration.shadow import shadow_calibrator
from cachesmith.scheduler import QueuedRequest
from cachesmith.scheduler.feasibility import SheddingConfig
from cachesmith.scoring import Expected
from cachesmith.shedding import SHED_KIND, SloUnattainable
from cachesmith.shadow_work import ShadowConfig
from cachesmith.workloads.prompts import instance_prompt
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline
from tests.planner.synthetic_profile import make_profile

pytestmark = pytest.mark.real_model  # borrows the packaged model's tokenizer


def submit(loop: EngineLoop, inst: WorkloadInstance, slo_s: float, on_token=None, slot=None,
           sampling: SamplingParams = GREEDY):
    """Queue an instance as a server queues a completion, in its queue place: its rules checked,
    its prompt keyed and stored, then the whole `Request` submitted."""
    pipe = loop.engine.pipeline
    slot = slot or loop.reserve()
    try:
        parts = instance_prompt(pipe, inst)
        check_slo(slo_s)
        check_fits(len(parts.token_ids), inst.max_new_tokens, pipe.model.config.max_positions, "documents")
        request = slot.request(pipe.stored_prompt(parts), slo_s, inst.max_new_tokens, sampling, Expected.of(inst))
    except BaseException:
        slot.release()
        raise
    return loop.submit(request, on_token, slot)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return tiny_pipeline(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-loop")), tmp_path_factory.mktemp("kv"))


def live_engine(pipe, method="cachesmith"):
    return Engine(pipe, make_profile(num_layers=pipe.model.num_layers), EngineConfig(method, "live"), LiveClock())


def test_concurrent_submits_all_resolve(pipe):
    loop = EngineLoop(live_engine(pipe))
    futures, lock = [], threading.Lock()

    def client(k):
        for i in range(3):
            f = submit(loop, instance(10 * k + i), 30.0)
            with lock:
                futures.append(f)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [f.result(timeout=60) for f in futures]
    assert len({r.request_id for r in results}) == 9
    assert all(r.error is None and r.is_on_time and r.first_token_s >= r.arrival_s for r in results)
    assert loop.close(timeout=10)


def test_refusals_queue_limit_and_drain_on_close(pipe):
    engine = live_engine(pipe)
    loop = EngineLoop(engine, max_queue=2)
    with pytest.raises(InputError, match="slo_s=-1.0"):
        submit(loop, instance(1), -1.0)
    big = replace(instance(2), documents=instance(2).documents * 8)
    with pytest.raises(InputError, match="exceed the model's 1024 positions"):
        submit(loop, big, 30.0)
    assert loop.queue_depth == 0  # their places were given back
    unstored = loop.submit(Request(999, None, 30.0))  # past the engine's own limits: refused, not raised
    assert "request 999: no stored prompt" in unstored.result(timeout=5).error and loop.queue_depth == 0
    gate = threading.Event()
    original = engine.prefill_batch

    def slow(decision, batch):  # hold the first batch so the queue fills behind it
        gate.wait(10)
        return original(decision, batch)

    engine.prefill_batch = slow
    first = submit(loop, instance(2), 30.0)
    deadline = time.monotonic() + 10
    while engine.queue_depth and time.monotonic() < deadline:  # wait until the loop took it
        time.sleep(0.001)
    assert engine.queue_depth == 0
    queued = [submit(loop, instance(3 + i), 30.0) for i in range(2)]
    with pytest.raises(QueueFull, match="max_queue=2") as err:
        submit(loop, instance(9), 30.0)
    assert err.value.retry_after_s > 0
    gate.set()
    assert loop.close(timeout=30)  # drains what was queued
    assert all(f.result(timeout=1).error is None for f in [first, *queued])
    with pytest.raises(EngineClosed):
        submit(loop, instance(4), 30.0)


def test_a_failing_batch_becomes_per_request_errors(pipe):
    engine = live_engine(pipe, "full_reuse")
    loop = EngineLoop(engine)
    original = engine.executor.prefill
    engine.executor.prefill = lambda d, b: (_ for _ in ()).throw(RuntimeError("kaboom"))
    res = submit(loop, instance(5), 30.0).result(timeout=10)
    assert "internal error while serving: kaboom" in res.error
    engine.executor.prefill = original
    assert submit(loop, instance(6), 30.0).result(timeout=30).error is None  # still serving
    assert loop.close(timeout=10)


def test_the_loop_needs_the_live_clock(pipe):
    with pytest.raises(ConfigError, match="live clock"):
        EngineLoop(Engine(pipe, make_profile(num_layers=pipe.model.num_layers)))


def test_tokens_stream_in_order_and_spell_the_answer(pipe):
    loop = EngineLoop(live_engine(pipe))
    seen: list[tuple[int, int, float]] = []
    res = submit(loop, instance(7), 30.0, on_token=lambda i, t: seen.append((i, t, loop.engine.clock.now())))
    res = res.result(timeout=30)
    assert res.error is None and res.num_output_tokens == len(seen) >= 1
    assert [i for i, _, _ in seen] == list(range(len(seen)))
    assert pipe.tokenizer.decode([t for _, t, _ in seen]).strip() == res.answer
    assert seen[0][2] >= res.first_token_s - 1e-6  # the first token goes out when the prefill ends
    assert loop.close(timeout=10)


def test_a_failing_decode_and_a_failing_sink_do_not_stop_the_loop(pipe):
    engine = live_engine(pipe, "full_reuse")
    loop = EngineLoop(engine)
    original = loop._decoding.step  # the decode thread's step over every decoding sequence
    loop._decoding.step = lambda: (_ for _ in ()).throw(RuntimeError("decode broke"))
    assert "internal error while decoding: decode broke" in submit(loop, instance(8), 30.0).result(timeout=10).error
    loop._decoding.step = original

    def bad_sink(i, t):
        raise ValueError("client went away")

    assert submit(loop, instance(9), 30.0, on_token=bad_sink).result(timeout=30).error is None
    assert loop.close(timeout=10)


def test_serial_decode_serves_and_streams_the_same(pipe):
    answers = {}
    for overlapped in (True, False):
        loop = EngineLoop(live_engine(pipe, "full_prefill"), is_decode_overlapped=overlapped)
        tokens: list[int] = []
        res = submit(loop, instance(11), 30.0, on_token=lambda i, t: tokens.append(t)).result(timeout=30)
        assert res.error is None and len(tokens) == res.num_output_tokens
        answers[overlapped] = (res.answer, tokens)
        assert loop.close(timeout=10)
    assert answers[True] == answers[False]


def test_cancel_drops_a_queued_request_but_not_a_running_one(pipe):
    engine = live_engine(pipe, "full_reuse")
    loop = EngineLoop(engine)
    gate, original = threading.Event(), engine.prefill_batch
    engine.prefill_batch = lambda d, b: (gate.wait(10), original(d, b))[1]
    running = submit(loop, instance(12), 30.0)
    deadline = time.monotonic() + 10
    while engine.queue_depth and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = submit(loop, instance(13), 30.0)
    assert loop.cancel(queued.request_id) and not loop.cancel(running.request_id)
    res = queued.result(timeout=1)
    assert res.error_kind == "cancelled" and "cancelled" in res.error and engine.queue_depth == 0
    gate.set()
    assert running.result(timeout=30).error is None and not loop.cancel(running.request_id)
    assert loop.close(timeout=10)


def _long(seed: int) -> WorkloadInstance:
    return replace(instance(seed), max_new_tokens=12)


def test_decode_steps_sequences_together_and_never_starts_during_a_prefill(pipe):
    loop = EngineLoop(live_engine(pipe, "full_reuse"))
    events: list[str] = []
    loop.trace = events.append  # called under the loop's lock: the order is the real one
    futures = [submit(loop, _long(40 + i), 30.0) for i in range(6)]
    results = [f.result(timeout=60) for f in futures]
    assert all(r.error is None for r in results) and loop.close(timeout=10)
    prefills = [e for e in events if e.startswith("prefill ")]
    assert len(prefills) == events.count("prefilled") >= 1
    is_prefilling = False
    for event in events:
        if event.startswith("prefill"):
            is_prefilling = event != "prefilled"
        else:
            assert not is_prefilling, events  # decode waits for the prefill batch (prefill priority)
    assert max(int(e.split()[1]) for e in events if e.startswith("step")) >= 2  # stepped together


def test_a_full_decode_set_makes_the_next_prefill_wait(pipe):
    loop = EngineLoop(live_engine(pipe, "full_reuse"), max_decoding=1)
    events: list[str] = []
    loop.trace = events.append
    decoding = threading.Event()
    futures = [submit(loop, _long(50), 30.0, on_token=lambda i, t: decoding.set())]
    assert decoding.wait(30)  # the first request is decoding: the next batches must wait for room
    futures += [submit(loop, _long(51 + i), 30.0) for i in range(2)]
    assert all(f.result(timeout=60).error is None for f in futures) and loop.close(timeout=10)
    prefills = [int(e.split()[1]) for e in events if e.startswith("prefill ")]
    assert len(prefills) >= 2 and set(prefills) == {0}  # each batch waited until decoding had room
    assert any(e.startswith("step") for e in events)


def test_sampled_requests_repeat_with_their_seed_and_report_logprobs(pipe):
    loop = EngineLoop(live_engine(pipe, "full_prefill"))
    hot = SamplingParams(temperature=1.5, seed=7, num_logprobs=2)
    first, again = (submit(loop, _long(60), 30.0, sampling=hot).result(timeout=30) for _ in range(2))
    greedy = submit(loop, _long(60), 30.0, sampling=SamplingParams(num_logprobs=1)).result(timeout=30)
    assert loop.close(timeout=10)
    assert first.error is None and first.output_token_ids == again.output_token_ids
    assert len(first.logprobs) == first.num_output_tokens == len(first.output_token_ids)
    # greedy: every chosen token is the most likely one, and its logprob is the top one's
    assert all(r.token_id == r.top[0][0] and r.logprob == r.top[0][1] for r in greedy.logprobs)


def test_idle_time_measures_shadow_samples_and_a_new_request_still_runs(pipe):
    """`cachesmith+learn` shadow-evaluates its served requests when nothing else runs (the real
    demand searches on the tiny model, fidelity gate), and the planner learns from them."""
    config = EngineConfig("cachesmith+learn", "live", shadow=ShadowConfig(fraction=1.0), shadow_work=shadow_calibrator)
    engine = Engine(pipe, make_profile(num_layers=pipe.model.num_layers), config, LiveClock())
    loop = EngineLoop(engine)
    assert all(f.result(timeout=60).error is None for f in [submit(loop, instance(i), 30.0) for i in range(2)])
    deadline = time.monotonic() + 120
    while engine.shadow.stats.num_samples < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    st = engine.shadow.stats
    assert (st.num_sampled, st.num_samples) == (2, 2) and st.num_units >= 4 and st.max_unit_s > 0
    assert engine.planner.learned.is_active and engine.planner.learned.num_samples == 2
    assert submit(loop, instance(7), 30.0).result(timeout=60).error is None  # serving goes on
    assert loop.close(timeout=30)


def test_places_are_held_from_acceptance_and_an_admission_that_raises_gives_its_back(pipe):
    engine = live_engine(pipe, "full_reuse")
    loop = EngineLoop(engine, max_queue=2)
    held = [loop.reserve(), loop.reserve()]  # accepted, not yet admitted (a server tokenizing them)
    with pytest.raises(QueueFull, match="2 requests waiting, max_queue=2"):
        loop.reserve()
    held[0].release()
    held[0].release()  # only the first release counts
    assert loop.queue_depth == 1
    held[1].release()
    original = engine.admit
    for error in (OSError("disk went away"), MemoryError("no room"), RuntimeError("bug")):
        engine.admit = lambda request, view=None, e=error: (_ for _ in ()).throw(e)
        for seed in range(3):  # more than max_queue: a leaked place would refuse the next
            res = submit(loop, instance(70 + seed), 30.0).result(timeout=5)
            assert res.is_internal_error and f"{type(error).__name__}: {error}" in res.error
        assert loop.queue_depth == 0
    engine.admit = original
    slot = loop.reserve()
    res = submit(loop, instance(80), 30.0, slot=slot).result(timeout=30)
    assert res.error is None and slot.is_released and loop.queue_depth == 0
    assert loop.close(timeout=10)  # nothing leaked: the drain ends


def test_a_request_priced_past_its_slo_is_refused_before_it_is_queued(pipe):
    loop = EngineLoop(live_engine(pipe), shedding=SheddingConfig(1.5))

    def priced(slot, slo_s, new_tokens):
        slot.view = QueuedRequest(slot.request_id, slot.arrival_s, slo_s, 300, 10, 20)
        return loop.check_deadline(slot, new_tokens)

    first, second = loop.reserve(), loop.reserve()
    admitted = priced(first, 30.0, [300])
    assert priced(second, 30.0, []).start_s > 0  # the first's prefill and batch are ahead of it
    tight = loop.reserve()
    with pytest.raises(SloUnattainable, match="slo_ms=1:"):  # behind them, 1 ms is out of reach
        priced(tight, 0.001, [300])
    tight.release()
    first.release(), second.release()  # refused or queued: a promise leaves with its place
    third = loop.reserve()
    assert priced(third, 30.0, []).start_s == 0.0 and admitted.own_s > 0
    third.release()
    assert loop.close(timeout=10)


@pytest.mark.parametrize("max_lateness", [1.5, None])
def test_queued_requests_past_saving_are_answered_refused_not_run(pipe, max_lateness):
    engine = live_engine(pipe, "full_reuse")
    loop = EngineLoop(engine, shedding=SheddingConfig(max_lateness))
    futures = []
    with loop._cond:  # both queued before the loop decides: each waits beside the other
        for i in (3, 4):
            slot = loop.reserve()
            prompt = pipe.stored_prompt(instance_prompt(pipe, instance(i)))
            # arrived 100 s ago with a 1 s SLO: past saving by any margin
            late = Request(slot.request_id, prompt, 1.0, 2, engine.clock.now() - 100.0)
            view = engine.admit(late)
            loop._enqueue(slot, late, view, future := RequestFuture(late.request_id), None)
            futures.append(future)
    results = [f.result(timeout=60) for f in futures]
    if max_lateness is None:  # queued however late: served
        assert all(r.error is None and not r.is_on_time for r in results) and loop.num_shed_queued == 0
    else:
        assert all(r.error_kind == SHED_KIND and "waited 100." in r.error and r.first_token_s is None
                   for r in results)
        assert loop.num_shed_queued == 2 and engine.stats.num_batches == 0
    assert loop.close(timeout=10)
