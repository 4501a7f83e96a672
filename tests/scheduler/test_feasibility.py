"""Feasibility: the earliest first token of a request, priced from the feasible work due first at the
cheapest plan, in one walk of the queue in deadline order."""
from __future__ import annotations

import pytest

from cachesmith.errors import ConfigError
from cachesmith.planner import BatchShape, Planner
from cachesmith.scheduler.feasibility import DeadlinePricer, SheddingConfig, infeasible, judge, walk
from cachesmith.scheduler.types import QueuedRequest, batch_shape
from tests.planner.synthetic_profile import make_profile


@pytest.fixture(scope="module")
def pricer():
    return DeadlinePricer(Planner(make_profile(num_layers=4)), max_batch_size=4)


def view(i: int, arrival: float = 0.0, slo: float = 2.0, context: int = 300) -> QueuedRequest:
    return QueuedRequest(i, arrival, slo, context, 12, 20)


def test_the_work_ahead_is_the_feasible_work_due_first_at_its_cheapest(pricer):
    me = view(0, arrival=1.0, slo=2.0)  # due at 3.0
    earlier = [view(i, arrival=0.5, slo=2.0) for i in range(1, 4)]  # due at 2.5
    later = [view(i, arrival=1.5, slo=2.0) for i in range(4, 6)]  # due at 3.5: served after it
    hopeless = view(9, arrival=-100.0, slo=1.0)  # due long ago: not work ahead of anyone
    verdict = judge(pricer, me, now=1.25, ahead=earlier + later + [hopeless, me], margin=1.0, busy_s=0.7)
    estimate = verdict.estimate
    assert verdict.is_feasible and estimate.waited_s == pytest.approx(0.25)
    assert estimate.start_s == pytest.approx(0.7 + pricer.cheapest_s(earlier))
    assert estimate.own_s == pytest.approx(pricer.cheapest_s([me]))
    assert estimate.ttft_s == pytest.approx(estimate.waited_s + estimate.start_s + estimate.own_s)
    assert "waited" in estimate.describe() and f"{estimate.ttft_s:.2f} s" in estimate.describe()
    # feasible exactly while its price is within its SLO
    edge = me.slo_s - estimate.waited_s - estimate.own_s  # the work running that leaves it just on time
    assert judge(pricer, me, 1.25, [], 1.0, edge - 1e-6).is_feasible
    assert not judge(pricer, me, 1.25, [], 1.0, edge + 1e-6).is_feasible
    # more work running pushes those due first past their own SLO: no longer ahead of it
    assert judge(pricer, me, 1.25, earlier, 1.0, edge - 1e-6).estimate.start_s == pytest.approx(edge - 1e-6)


def test_one_walk_in_deadline_order_decides_a_whole_queue(pricer):
    one = pricer.alone_s(view(0))
    # five due at once with room for the first four batched (one batch at most 4): the fifth waits
    # behind them; a request infeasible on its own is not work ahead of the rest
    hopeless = view(9, arrival=-50.0, slo=1.0)
    slo = pricer.cheapest_s([view(i) for i in range(4)]) + one + 1e-6
    queue = [view(i, slo=slo) for i in range(5)] + [hopeless]
    verdicts = list(walk(pricer, queue, 0.0, margin=1.0))
    assert [v.request.request_id for v in verdicts] == [9, 0, 1, 2, 3, 4]  # deadline order
    assert [v.is_feasible for v in verdicts] == [False, True, True, True, True, True]
    assert verdicts[-1].estimate.start_s == pytest.approx(pricer.cheapest_s(queue[:4]))
    assert [v.request.request_id for v in infeasible(pricer, queue, 0.0, 1.0)] == [9]
    # 0.1 s less room: the fifth is out, and only it
    assert [v.request.request_id for v in infeasible(pricer, queue, 0.0, (slo - 0.1 * one) / slo)] == [9, 4]


def test_requests_ahead_are_batched_as_densely_as_the_scheduler_may(pricer):
    queue = [view(i, arrival=0.1 * i) for i in range(8)]
    first, second = pricer.cheapest_s(queue[:4]), pricer.cheapest_s(queue[4:])
    assert pricer.cheapest_s(queue) == pytest.approx(first + second)
    # a batch shares its overhead: cheaper than its requests one by one
    assert first < sum(pricer.cheapest_s([r]) for r in queue[:4])
    # priced at full reuse: cheaper than full prefill of the same batch
    assert first < pricer.planner.cost.full_prefill_ttft(batch_shape(queue[:4]))


def test_documents_not_yet_stored_add_their_prefill(pricer):
    me = view(0)
    bare = judge(pricer, me, 0.0, [], 1.0).estimate
    with_new = judge(pricer, me, 0.0, [], 1.0, num_new_tokens=[200, 0, 100]).estimate
    cost = pricer.planner.cost
    per_batch = cost.full_prefill_ttft(BatchShape((0,), (1,), (0,)))
    # each at the full prefill's price per token: a chunk's forward pass runs no recompute layer loop
    expected = sum(cost.full_prefill_ttft(BatchShape((n,), (1,), (0,))) - per_batch for n in (200, 100))
    assert with_new.own_s - bare.own_s == pytest.approx(expected) and 0 < expected
    assert pricer.prefill_s([200]) < cost.full_prefill_ttft(BatchShape((200,), (1,), (0,)))


def test_the_learned_pace_scales_every_price(pricer, monkeypatch):
    me = view(0)
    base = pricer.cheapest_s([me])
    monkeypatch.setattr(pricer.planner, "pace", lambda signal, probe, num_tokens: 2.0)
    assert pricer.cheapest_s([me]) == pytest.approx(2 * base)


def test_the_shedding_margin():
    assert SheddingConfig(1.5).is_on and not SheddingConfig(None).is_on
    for bad in (0.5, 0.0, 101.0):
        with pytest.raises(ConfigError, match="max_lateness"):
            SheddingConfig(bad)


def test_new_documents_are_priced_at_the_pace_measured_on_chunk_prefills():
    pricer = DeadlinePricer(Planner(make_profile(num_layers=4)), max_batch_size=4)
    planned = pricer.prefill_s([300])
    pricer.observe_prefill(300, 3 * planned)  # one is too few to trust: the planner's pace still prices
    assert pricer.prefill_s([300]) == pytest.approx(planned)
    pricer.observe_prefill(100, 3 * pricer.prefill_s([100]))
    assert pricer.prefill_pace == pytest.approx(3.0)
    assert pricer.prefill_s([300]) == pytest.approx(3 * planned)
    for _ in range(64):  # a machine gone wild is believed only so far
        pricer.observe_prefill(300, 1e3 * planned)
    assert pricer.prefill_pace == 8.0
