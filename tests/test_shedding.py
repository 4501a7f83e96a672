"""Deadline-aware admission's bookkeeping: refusals at arrival with their retry time, the work
promised by admissions in progress, and queued requests no longer feasible, shed at a boundary."""
from __future__ import annotations

import pytest

from cachesmith.planner import Planner
from cachesmith.scheduler.feasibility import DeadlinePricer, PromptSize, SheddingConfig, TtftEstimate, infeasible
from cachesmith.scheduler.types import QueuedRequest
from cachesmith.shedding import DeadlineAdmission, SloUnattainable, retry_after_s
from tests.planner.synthetic_profile import make_profile



def arrive(adm, request_id, arrival_s, slo_s, now, queued, size):
    """A request checked at its arrival, its view made from its text as the serving front does."""
    adm.check_arrival(adm.pricer.guessed(request_id, arrival_s, slo_s, size), now, queued, size)

def admission(max_lateness: float | None = 1.5) -> DeadlineAdmission:
    return DeadlineAdmission(DeadlinePricer(Planner(make_profile(num_layers=4)), 4), SheddingConfig(max_lateness))


def view(i: int, arrival: float = 0.0, slo: float = 2.0) -> QueuedRequest:
    return QueuedRequest(i, arrival, slo, 300, 12, 20)


def test_a_request_past_the_margin_is_refused_with_its_estimate_and_a_retry_time():
    adm = admission()
    ahead = [view(i, slo=0.25) for i in range(1, 40)]  # due first: those still feasible are ahead
    late = {v.request.request_id for v in infeasible(adm.pricer, ahead, 0.0, 1.5)}
    work = adm.pricer.cheapest_s([r for r in ahead if r.request_id not in late])
    assert late and work > 0.3
    with pytest.raises(SloUnattainable) as refused:
        adm.admit(view(0, arrival=0.0, slo=0.25), 0.0, ahead, [])
    message = str(refused.value)
    assert "slo_ms=250" in message and "--shed-late" in message and "1.5x" in message
    own = adm.pricer.cheapest_s([view(0)])
    assert refused.value.retry_after_s == pytest.approx(work - (1.5 * 0.25 - own))
    assert adm.busy_s(0.0) == 0.0  # a refusal promises no work
    assert adm.admit(view(0, arrival=0.0, slo=30.0), 0.0, ahead, []) is not None  # a looser SLO


def test_an_admission_in_progress_is_work_ahead_of_later_arrivals_until_it_settles():
    adm = admission()
    first = adm.admit(view(0, slo=60.0), 0.0, [], [400])
    assert first.start_s == 0.0 and first.prefill_s > 0
    second = adm.admit(view(1, slo=60.0), 0.0, [], [])
    assert second.start_s == pytest.approx(first.own_s)  # the first's prefill and its batch
    # its documents' prefill drains with the clock; each batch is still to run, alone: its request
    # joins the queue only once its documents are stored
    later_s = first.prefill_s + 10.0
    assert adm.busy_s(later_s, request_id=2) == pytest.approx(first.run_s + second.run_s)
    later = adm.admit(view(2, arrival=later_s, slo=60.0), later_s, [], [])
    assert later.start_s == pytest.approx(2 * adm.pricer.alone_s(view(0)))
    adm.settle(0), adm.settle(1)
    assert adm.busy_s(0.0, request_id=2) == 0.0
    adm.batch_ends_s = 5.0
    assert adm.busy_s(4.0, request_id=2) == pytest.approx(1.0) and adm.busy_s(6.0, request_id=2) == 0.0


def test_admissions_prefill_one_after_another_so_their_promises_drain_in_turn():
    """Two admissions promised at once with p seconds of new documents each: the admission lock
    prefills them in turn, so p/2 later 1.5p of prefill is ahead, not 2 x p/2; once the first
    ended, the second prefills from then."""
    adm = admission()
    first = adm.admit(view(0, slo=600.0), 0.0, [], [1000])
    p, run = first.prefill_s, first.run_s  # its batch alone, priced after its prefill
    adm.admit(view(1, slo=600.0), 0.0, [], [1000])
    assert adm.busy_s(0.5 * p, request_id=9) == pytest.approx(1.5 * p + 2 * run)
    adm.settle(0, now=1.2 * p)  # the first ended later than priced: the second prefills from then
    assert adm.busy_s(1.2 * p, request_id=9) == pytest.approx(p + run)
    assert adm.busy_s(2.2 * p, request_id=9) == pytest.approx(run)


def test_a_request_late_even_alone_is_refused_and_told_why():
    adm = admission()
    with pytest.raises(SloUnattainable, match="even alone on an idle server") as refused:
        adm.admit(view(0, slo=0.001), 0.0, [], [])
    assert refused.value.retry_after_s == 0.0  # nothing ahead to wait for: only a looser SLO helps
    # at arrival its size is a guess: alone it passes, to be priced exactly after tokenizing
    arrive(adm, 1, 0.0, 0.001, 0.0, [], PromptSize((4000,), 100))
    with pytest.raises(SloUnattainable, match="sized from its text"):  # behind work, the guess refuses
        arrive(adm, 2, 0.0, 0.001, 0.0, [], PromptSize((4000,), 100))
    # queued, alone, it is shed too: it would be late whoever else waits
    assert [v.request_id for v, _ in adm.expired([view(7, arrival=-5.0, slo=0.001)], 0.0)] == [7]


def test_with_shedding_off_nothing_is_refused_or_priced():
    adm = admission(None)
    assert adm.admit(view(0, slo=0.001), 0.0, [], [4000]) is None
    arrive(adm, 1, 0.0, 0.001, 0.0, [], PromptSize((40_000,), 100))
    assert adm.busy_s(0.0) == 0.0
    assert adm.expired([view(1, arrival=-1e3, slo=0.001)], 0.0) == []


def test_queued_requests_no_longer_feasible_are_listed_with_their_message():
    adm = admission()
    fresh, stale = view(0, arrival=9.0, slo=2.0), view(1, arrival=0.0, slo=2.0)
    expired = adm.expired([fresh, stale], now=10.0)
    assert [v.request_id for v, _ in expired] == [1]
    assert "waited 10.00 s" in expired[0][1] and "--shed-late" in expired[0][1]
    # at 1.5x: 2.0 s waited + its own run is still within 3 s, so it is not shed
    assert adm.expired([view(2, arrival=8.0, slo=2.0), fresh], now=10.0) == []


def test_a_request_feasible_alone_is_shed_behind_work_due_first():
    adm = admission()
    run_s = adm.pricer.alone_s(view(0))
    first = [view(1, slo=1.4 * run_s)]  # due first, and feasible
    mine = QueuedRequest(0, 0.5 * run_s, run_s, 300, 12, 20)  # due after them; alone within 1.5x
    assert adm.expired([mine], 0.5 * run_s) == []
    behind = adm.expired([*first, mine], 0.5 * run_s)
    assert [v.request_id for v, _ in behind] == [0] and "behind" in behind[0][1]


def test_a_request_too_large_to_be_on_time_alone_is_told_when_the_queue_drains():
    estimate = TtftEstimate(0.0, 4.0, 0.0, 10.0)
    assert retry_after_s(estimate, slo_s=2.0, max_lateness=1.5) == 4.0
    assert retry_after_s(TtftEstimate(0.0, 4.0, 0.0, 1.0), 2.0, 1.5) == pytest.approx(2.0)


def test_queued_requests_not_feasible_are_not_work_ahead_of_an_arrival():
    adm = admission()
    doomed = [view(i, arrival=-10.0, slo=0.5) for i in range(1, 40)]  # waited 10 s against 0.75 s allowed
    assert len(adm.expired(doomed, 0.0)) == len(doomed)
    alone = adm.admit(view(0, slo=0.2), 0.0, [], [])
    adm.settle(0)
    behind = adm.admit(view(0, slo=0.2), 0.0, doomed, [])  # due later than all of them, and admitted
    assert behind.start_s == pytest.approx(alone.start_s) and behind.ttft_s == pytest.approx(alone.ttft_s)
    adm.settle(0)
    in_time = view(2, arrival=0.0, slo=0.1)
    assert adm.admit(view(0, slo=20.0), 0.0, [in_time], []).start_s == pytest.approx(adm.pricer.alone_s(in_time))


def test_the_running_batch_is_work_ahead_at_its_cheapest_until_it_ends():
    adm = admission()
    batch = [view(i) for i in range(3)]
    adm.start_batch(batch, now=10.0)
    assert adm.busy_s(10.0) == pytest.approx(adm.pricer.cheapest_s(batch))
    adm.end_batch()  # a batch that ends early stops counting at once
    assert adm.busy_s(10.0) == 0.0


def test_an_arrival_sized_from_its_text_is_promised_ahead_of_later_arrivals_until_it_is_priced():
    adm = admission()
    size = PromptSize((4000, 4000), 200)  # two documents of about 1,000 tokens, none stored yet
    arrive(adm, 0, 0.0, 60.0, 0.0, [], size)
    view0, new0 = adm.pricer.guessed(0, 0.0, 60.0, size), adm.pricer.sizes.guess(size)[2]
    assert view0.context_tokens == 2000 and new0 == [1000, 1000]  # 4 characters a token, all new
    assert adm.busy_s(0.0, request_id=1) == pytest.approx(adm.pricer.prefill_s(new0) + adm.pricer.alone_s(view0))
    small = PromptSize((), 40)  # nothing of its own to prefill
    small_view = adm.pricer.guessed(1, 0.0, 1.0, small)
    # a burst behind it is refused in order, before anyone is tokenized
    ahead_s = adm.pricer.prefill_s(new0) + adm.pricer.alone_s(view0)
    slo = (ahead_s + adm.pricer.alone_s(small_view)) / 1.5 + 1e-3
    arrive(adm, 1, 0.0, slo, 0.0, [], small)  # in time behind the first
    with pytest.raises(SloUnattainable, match="sized from its text"):
        arrive(adm, 2, 0.0, slo, 0.0, [], size)
    adm.admit(view(0, slo=60.0), 0.0, [], [])  # tokenized: every document was stored after all
    assert adm.busy_s(0.0, request_id=1) == pytest.approx(adm.pricer.alone_s(view(0)))  # its batch alone
    adm.settle(0), adm.settle(1)
    assert adm.admit(view(9, slo=60.0), 0.0, [], []).start_s == 0.0


def test_the_size_guess_learns_characters_per_token_and_the_share_of_documents_not_stored():
    sizes = admission().pricer.sizes
    docs, other, new = sizes.guess(PromptSize((400, 0), 40))  # a stored chunk by id counts nothing
    assert docs == (100, 0) and other == 10 and new == [100]  # the defaults: 4 characters a token, all new
    sizes.observe(3000, 1000, 250)
    docs, other, new = sizes.guess(PromptSize((600,), 30))
    assert docs == (200,) and other == 10 and new == [50]
