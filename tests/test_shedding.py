"""Deadline-aware admission's bookkeeping: refusals at arrival with their retry time, the work
promised by admissions in progress, queued requests past saving, and the estimates' errors."""
from __future__ import annotations

import math

import pytest

from cachesmith.planner import Planner
from cachesmith.scheduler.deadline import DeadlinePricer, PromptSize, SheddingConfig, TtftEstimate
from cachesmith.scheduler.types import QueuedRequest
from cachesmith.shedding import DeadlineAdmission, EstimateErrors, SloUnattainable, is_full_reuse, retry_after_s
from tests.planner.synthetic_profile import make_profile


def admission(max_lateness: float | None = 1.5) -> DeadlineAdmission:
    return DeadlineAdmission(DeadlinePricer(Planner(make_profile(num_layers=4)), 4), SheddingConfig(max_lateness))


def view(i: int, arrival: float = 0.0, slo: float = 2.0) -> QueuedRequest:
    return QueuedRequest(i, arrival, slo, 300, 12, 20)


def test_a_request_past_the_margin_is_refused_with_its_estimate_and_a_retry_time():
    adm = admission()
    ahead = [view(i, slo=0.2) for i in range(1, 40)]  # due first, and longer at their cheapest than 1.5x
    work = adm.pricer.cheapest_s(ahead)
    assert work > 0.45
    with pytest.raises(SloUnattainable) as refused:
        adm.admit(view(0, arrival=0.0, slo=0.3), 0.0, ahead, [])
    message = str(refused.value)
    assert "slo_ms=300" in message and "--shed-late" in message and "1.5x" in message
    own = adm.pricer.cheapest_s([view(0)])
    assert refused.value.retry_after_s == pytest.approx(work - (1.5 * 0.3 - own))
    assert adm.busy_s(0.0) == 0.0  # a refusal promises no work
    adm.admit(view(0, arrival=0.0, slo=30.0), 0.0, ahead, [])  # the same work ahead, a looser SLO


def test_an_admission_in_progress_is_work_ahead_of_later_arrivals_until_it_settles():
    adm = admission()
    first = adm.admit(view(0), 0.0, [], [400])
    assert first.start_s == 0.0
    second = adm.admit(view(1), 0.0, [], [])
    assert second.start_s == pytest.approx(first.own_s)  # the first's prefill and its batch
    prefill_s = first.own_s - adm.pricer.cheapest_s([view(0)])
    # its documents' prefill drains with the clock; its batch is still to run
    assert adm.busy_s(prefill_s + 10.0, request_id=1) == pytest.approx(adm.pricer.cheapest_s([view(0)]))
    adm.settle(0)
    assert adm.busy_s(0.0, request_id=1) == 0.0
    adm.batch_ends_s = 5.0
    assert adm.busy_s(4.0, request_id=1) == pytest.approx(1.0) and adm.busy_s(6.0, request_id=1) == 0.0


def test_a_request_late_even_alone_is_refused_only_behind_work():
    adm = admission()
    hopeless = view(0, slo=0.001)
    alone = adm.admit(hopeless, 0.0, [], [])  # nothing ahead: served (at full reuse), not refused forever
    assert alone.start_s == 0.0 and alone.own_s > 1.5 * 0.001
    with pytest.raises(SloUnattainable, match="even alone on an idle server") as refused:
        adm.admit(view(1, slo=0.001), 0.0, [], [])  # behind the first: told to come back when it is done
    assert refused.value.retry_after_s == pytest.approx(adm.busy_s(0.0, request_id=1))
    # queued, it is not shed for lateness no load caused; one queued without a promise is
    other = view(7, arrival=-5.0, slo=0.001)
    assert [v.request_id for v, _ in adm.expired([view(0, arrival=-5.0, slo=0.001), other], 0.0)] == [7]


def test_with_shedding_off_nothing_is_refused_but_the_estimate_is_kept():
    adm = admission(None)
    estimate = adm.admit(view(0, slo=0.001), 0.0, [], [4000])
    assert estimate.ttft_s > 0.1
    assert adm.expired([view(1, arrival=-1e3, slo=0.001)], 0.0) == []


def test_a_queued_request_past_saving_is_listed_with_its_message():
    adm = admission()
    fresh, stale = view(0, arrival=9.0, slo=2.0), view(1, arrival=0.0, slo=2.0)
    expired = adm.expired([fresh, stale], now=10.0)
    assert [v.request_id for v, _ in expired] == [1]
    assert "waited 10.00 s" in expired[0][1] and "--shed-late" in expired[0][1]
    # at 1.5x: 2.0 s waited + its own run is still within 3 s, so it is not shed
    assert adm.expired([view(2, arrival=8.0, slo=2.0), fresh], now=10.0) == []
    # alone in the queue, a late request delays no one waiting: it runs
    assert adm.expired([stale], now=10.0) == []


def test_a_request_too_large_to_be_on_time_alone_is_told_when_the_queue_drains():
    estimate = TtftEstimate(0.0, 4.0, 0.0, 10.0)
    assert retry_after_s(estimate, slo_s=2.0, max_lateness=1.5) == 4.0
    assert retry_after_s(TtftEstimate(0.0, 4.0, 0.0, 1.0), 2.0, 1.5) == pytest.approx(2.0)


def test_estimate_errors_are_ratios_over_a_window():
    errors = EstimateErrors(window=4)
    assert errors.quantiles() == {}
    for estimated, measured in ((1.0, 1.0), (1.0, 2.0), (2.0, 3.0), (1.0, 4.0), (1.0, 8.0), (0.0, 1.0)):
        errors.observe(estimated, measured)
    assert errors.num_observed == 5  # a zero estimate is not a ratio
    q = errors.quantiles((0.5, 0.9))
    assert q == {"0.5": 4.0, "0.9": 8.0}  # the window holds 2, 1.5, 4, 8


def test_the_lateness_ratio_learns_only_from_requests_served_at_their_cheapest_plan():
    errors = EstimateErrors()
    for _ in range(10):
        errors.observe(1.0, 6.0)  # the planner spent slack on recomputation: not the estimate's error
    assert errors.lateness_ratio == 1.0
    for measured in (1.1, 1.2, 1.3):
        errors.observe(1.0, measured, is_cheapest=True)
    assert errors.lateness_ratio == 1.0  # too few yet
    errors.observe(1.0, 1.25, is_cheapest=True)
    assert errors.lateness_ratio == pytest.approx(1.225)
    for _ in range(8):
        errors.observe(1.0, 0.5, is_cheapest=True)  # an estimate that erred high keeps the bound as priced
    assert errors.lateness_ratio == 1.0
    for _ in range(64):
        errors.observe(1.0, 9.0, is_cheapest=True)
    assert errors.lateness_ratio == 2.0  # capped: slow batches must not refuse everything


def test_only_a_request_that_ran_full_reuse_ran_the_plan_its_estimate_priced():
    assert is_full_reuse("(position,0,0,0%)", 0)
    assert not is_full_reuse("(position,0,0,15%)", 120)  # EPIC recomputes rows
    assert not is_full_reuse("(kv_dev,1,0,0%)", 0)  # a warm-up layer of full prefill
    assert not is_full_reuse("(qci,0,1,0%)", 0)  # a probe pass
    assert not is_full_reuse("", 0)  # never ran


def test_a_request_admitted_at_the_priced_bound_is_refused_at_the_measured_lateness():
    adm = admission()
    ahead = [view(i, slo=0.1) for i in range(1, 9)]  # due first, and none past saving: all ahead
    assert adm.expired(ahead, 0.0) == []
    bound = adm.pricer.estimate(view(0, slo=1.0), 0.0, ahead, 0.0).ttft_s
    slo = bound / 1.4  # priced at 1.4x its SLO: within the 1.5x margin
    adm.admit(view(0, slo=slo), 0.0, ahead, [])
    adm.settle(0)
    for _ in range(4):
        adm.errors.observe(1.0, 1.2, is_cheapest=True)  # requests here land 1.2x later than priced
    with pytest.raises(SloUnattainable, match=r"x 1\.20") as refused:
        adm.admit(view(0, slo=slo), 0.0, ahead, [])
    assert f"{1.2 * bound:.2f} s" in str(refused.value)
    assert adm.busy_s(0.0) == 0.0


def test_queued_requests_past_saving_are_not_work_ahead_they_are_shed_not_run():
    adm = admission()
    doomed = [view(i, arrival=-10.0, slo=0.5) for i in range(1, 40)]  # waited 10 s against 0.75 s allowed
    assert len(adm.expired(doomed, 0.0)) == len(doomed)
    alone = adm.admit(view(0, slo=0.2), 0.0, [], [])
    adm.settle(0)
    behind = adm.admit(view(0, slo=0.2), 0.0, doomed, [])  # due later than all of them, and admitted
    assert behind.start_s == pytest.approx(alone.start_s) and behind.ttft_s == pytest.approx(alone.ttft_s)


def test_a_queued_request_late_even_alone_is_not_work_ahead_though_it_is_not_shed_yet():
    """The scheduler holds a doomed request back while anyone can still be on time, so an arrival
    is priced without it; a queued request still in time is work ahead."""
    adm = admission()
    run_s = adm.pricer.cheapest_s([view(1)])
    doomed = view(1, arrival=-0.2 * run_s, slo=run_s)  # 1.2x its SLO even if started now: within the margin
    in_time = view(2, arrival=0.0, slo=10 * run_s)
    assert adm.expired([doomed, in_time], 0.0) == []  # not past saving: it is kept, not shed
    alone = adm.admit(view(0, slo=20 * run_s), 0.0, [], [])
    adm.settle(0)
    assert adm.admit(view(0, slo=20 * run_s), 0.0, [doomed], []).start_s == pytest.approx(alone.start_s)
    adm.settle(0)
    assert adm.admit(view(0, slo=20 * run_s), 0.0, [in_time], []).start_s == pytest.approx(alone.start_s + run_s)


def test_the_next_expiry_is_when_the_first_queued_request_becomes_past_saving():
    adm = admission()
    run_s = adm.pricer.cheapest_s([view(1)])
    a, b = view(1, arrival=0.0, slo=run_s), view(2, arrival=1.0, slo=run_s)
    due = adm.next_expiry_s([b, a], 0.0)
    assert due == pytest.approx(1.5 * run_s - run_s)  # a's first token passes 1.5x its SLO from then
    assert adm.expired([a, b], due - 1e-6) == [] and [v.request_id for v, _ in adm.expired([a, b], due + 1e-6)] == [1]
    assert adm.next_expiry_s([a], 0.0) == math.inf  # alone, it is never shed
    assert admission(None).next_expiry_s([a, b], 0.0) == math.inf


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
    adm.check_arrival(0, 0.0, 60.0, 0.0, [], size)
    guessed = adm.busy_s(0.0, request_id=1)
    view0, new0 = adm.pricer.guessed(0, 0.0, 60.0, size)
    assert view0.context_tokens == 2000 and new0 == [1000, 1000]  # 4 characters a token, all new
    own = adm.pricer.prefill_s(new0) + adm.pricer.cheapest_s([view0])
    assert guessed == pytest.approx(own) and guessed > adm.pricer.prefill_s([1000])  # its prefill and batch
    # a burst behind it is refused in order, before anyone is tokenized
    small = PromptSize((), 40)  # nothing of its own to prefill
    slo = (own + adm.pricer.cheapest_s([adm.pricer.guessed(1, 0.0, 1.0, small)[0]])) / 1.5 + 1e-3
    adm.check_arrival(1, 0.0, slo, 0.0, [], small)  # in time behind the first
    with pytest.raises(SloUnattainable, match="sized from its text"):
        adm.check_arrival(2, 0.0, slo, 0.0, [], size)
    exact = adm.admit(view(0, slo=60.0), 0.0, [], [])  # tokenized: every document was stored after all
    assert adm.busy_s(0.0, request_id=9) - adm.busy_s(0.0, request_id=0) == pytest.approx(exact.own_s)
    adm.settle(0)
    adm.settle(1)
    assert adm.busy_s(0.0, request_id=9) == 0.0


def test_the_size_guess_learns_characters_per_token_and_the_share_of_documents_not_stored():
    sizes = admission().pricer.sizes
    docs, other, new = sizes.guess(PromptSize((400, 0), 40))  # a stored chunk by id counts nothing
    assert docs == (100, 0) and other == 10 and new == [100]  # the defaults: 4 characters a token, all new
    sizes.observe(3000, 1000, 250)
    docs, other, new = sizes.guess(PromptSize((600,), 30))
    assert docs == (200,) and other == 10 and new == [50]
