"""The SLO-aware scheduler on hand-built queues (synthetic profile, no timing)."""
from __future__ import annotations

import pytest

from cachesmith.errors import InputError
from cachesmith.planner import Planner
from cachesmith.recompute import preset
from cachesmith.scheduler import FcfsQueueAware, FcfsStatic, QueuedRequest, SchedulerConfig, SloAwareScheduler
from cachesmith.scheduler.buckets import compositions
from cachesmith.scheduler.feasibility import infeasible
from tests.planner.synthetic_profile import make_profile


@pytest.fixture(scope="module")
def scheduler():
    return SloAwareScheduler(Planner(make_profile()))


def drain(scheduler, queue):
    """Run decisions back to back (each batch takes its budget); returns [(decision, end time)]."""
    now, out, queue = 0.0, [], list(queue)
    while queue:
        d = scheduler.next_batch(queue, now)
        now += d.budget_s
        out.append((d, now))
        queue = [r for r in queue if r.request_id not in d.request_ids]
    return out


def test_paper_figure_4_doomed_urgent_short_and_long(scheduler):
    """A doomed request, an urgent short one and a long one: (c) serves short and long apart,
    each in its band, and the doomed one at full reuse, never in their way."""
    f_short = scheduler.floor(QueuedRequest(0, 0, 1, 512, 32))
    f_long = scheduler.floor(QueuedRequest(0, 0, 1, 4096, 32))
    cheapest = scheduler.pricer.alone_s(QueuedRequest(0, 0, 1, 1024, 32))  # its full reuse alone
    doomed = QueuedRequest(0, 0.0, 0.5 * cheapest, 1024, 32)
    short = QueuedRequest(1, 0.0, 1.3 * f_short, 512, 32)
    long = QueuedRequest(2, 0.0, 1.3 * f_short + 1.6 * f_long, 4096, 32)
    run = drain(scheduler, [doomed, short, long])
    first, t1 = run[0]
    assert first.request_ids == (1,) and first.mode == "planned" and first.doomed_ids == (0,)
    assert t1 <= short.deadline_s
    by_id = {rid: (d, t) for d, t in run for rid in d.request_ids}
    assert by_id[2][0].request_ids == (2,) and by_id[2][1] <= long.deadline_s
    assert by_id[0][0].request_ids == (0,) and by_id[0][0].mode == "full_reuse"
    # FCFS under a static preset batches all three and the urgent one misses
    fcfs = FcfsStatic(preset("cacheblend", 0.15, 30), scheduler.planner.cost)
    (batch, t), = drain(fcfs, [doomed, short, long])
    assert batch.request_ids == (0, 1, 2) and t > short.deadline_s


def test_queue_aware_fcfs_sends_the_doomed_to_full_reuse(scheduler):
    fcfs = FcfsQueueAware(preset("cacheblend", 0.15, 30), scheduler.planner.cost)
    doomed = QueuedRequest(0, 0.0, 0.01, 1024, 32)
    ok = QueuedRequest(1, 0.0, 100.0, 1024, 32)
    d = fcfs.next_batch([doomed, ok], 0.0)
    assert d.request_ids == (0,) and d.mode == "full_reuse" and d.static_plan.coverage == 0.0
    assert fcfs.next_batch([ok], d.budget_s).mode == "static"


def test_only_doomed_requests_run_at_full_reuse_with_free_coverage(scheduler):
    d = scheduler.next_batch([QueuedRequest(i, 0.0, 0.01, 2048, 32) for i in range(3)], 0.0)
    assert d.mode == "full_reuse" and d.request_ids == (0, 1, 2)
    assert d.static_plan.warmup == 0 and 0.0 <= d.coverage <= 1.0


def test_a_doomed_batch_ends_before_the_predicted_next_arrival():
    """Requests arriving faster than a doomed batch runs: one doomed request at a time, so each
    arrival waits behind at most one; with arrivals further apart than the whole batch, one batch."""
    doomed = [QueuedRequest(i, 0.0, 0.01, 2048, 32) for i in range(3)]
    one, two, whole = (SloAwareScheduler(Planner(make_profile())).full_reuse_s(doomed[:k])[0] for k in (1, 2, 3))

    def doomed_batch(gap_s: float) -> tuple[int, ...]:
        sched = SloAwareScheduler(Planner(make_profile()))
        for i in range(20):  # past arrivals every gap_s, the latest just now
            sched.arrivals.observe(100 + i, 10.0 - gap_s * (19 - i), 1.0, 0.5)
        return sched.next_batch(doomed, 10.0).request_ids

    assert one < two < whole
    assert doomed_batch(0.5 * one) == (0,)
    assert doomed_batch(0.5 * (two + whole)) == (0, 1)  # as many as end before it
    assert doomed_batch(2.0 * whole) == (0, 1, 2)


def test_doomed_means_not_feasible_at_its_slo_behind_the_work_due_first():
    """The scheduler's doomed requests are exactly those the feasibility walk finds infeasible at
    margin 1: one in time alone is doomed behind enough feasible work due first."""
    sched = SloAwareScheduler(Planner(make_profile()))
    shape = QueuedRequest(0, 0.0, 1.0, 2048, 32)
    slo = 1.01 * sched.floor(shape)  # alone, in time even at its band's floor
    behind = QueuedRequest(99, 0.0, slo, 2048, 32)
    assert sched.next_batch([behind], 0.0).doomed_ids == ()
    ahead: list[QueuedRequest] = []
    while not infeasible(sched.pricer, [*ahead, behind], 0.0, 1.0):
        ahead.append(QueuedRequest(len(ahead), 0.0, slo - 1e-6, 2048, 32))  # due just before it
    verdicts = infeasible(sched.pricer, [*ahead, behind], 0.0, 1.0)
    assert [v.request.request_id for v in verdicts] == [99]  # every request ahead is feasible
    assert sched.next_batch([*ahead, behind], 0.0).doomed_ids == (99,)


def test_relaxed_queue_is_served_in_one_batch(scheduler):
    queue = [QueuedRequest(i, 0.0, 1000.0, 512, 32) for i in range(5)]
    d = scheduler.next_batch(queue, 0.0)
    assert set(d.request_ids) == set(range(5)) and d.expected_on_time == 5
    _, saturation = scheduler.band(queue)
    assert d.budget_s >= saturation - 1e-9  # nothing waits: the budget may pass saturation


def test_the_budget_stops_where_a_waiting_request_would_miss():
    """Algorithm 1 raises a batch's budget "until a request would miss its deadline": inside the
    band too, the waiting queue (FCFS at floors behind the batch) keeps its deadlines."""
    sched = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(max_batch_size=1))
    probe = QueuedRequest(0, 0.0, 1.0, 1024, 32)
    floor, saturation = sched.band([probe])
    deadline = 1.5 * saturation  # the batch alone could take its whole band
    queue = [QueuedRequest(i, 0.0, deadline, 1024, 32) for i in range(4)]  # one runs, three wait
    d = sched.next_batch(queue, 0.0)
    assert d.expected_on_time == 4
    assert floor <= d.budget_s <= deadline - 3 * floor + 1e-9 < saturation
    run = drain(sched, queue)
    assert run[0][1] + 3 * floor <= deadline + 1e-9  # the first batch leaves the rest their floors


def test_past_saturation_the_predicted_next_arrival_keeps_its_band():
    """An empty queue lets a batch pass saturation up to its deadline, unless the measured arrivals
    predict a request soon whose own saturation budget would no longer fit before its deadline."""
    relaxed = QueuedRequest(100, 50.0, 1000.0, 1024, 32)
    _, saturation = SloAwareScheduler(Planner(make_profile())).band([relaxed])

    def budget_after(gap_s: float) -> float:
        sched = SloAwareScheduler(Planner(make_profile()))
        for i in range(20):  # past requests like this one, with a tight SLO, every gap_s
            sched.arrivals.observe(i, 50.0 - gap_s * (20 - i), 1.2 * saturation, saturation)
        return sched.next_batch([relaxed], 50.0).budget_s

    busy = budget_after(0.1 * saturation)  # the next request is due within the batch
    assert busy == pytest.approx(saturation)
    # arrivals 100 s apart: past saturation up to where the next one (due 100 s after this one)
    # still has its saturation budget before its 1.2 x saturation deadline
    quiet = budget_after(100.0)
    assert quiet == pytest.approx(100.0 + 0.2 * saturation) and quiet > 10 * saturation
    off = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(is_arrival_aware=False))
    for i in range(20):
        off.arrivals.observe(i, 50.0 - 0.1 * saturation * (20 - i), 1.2 * saturation, saturation)
    assert off.next_batch([relaxed], 50.0).budget_s == pytest.approx(1000.0 * (1 - SchedulerConfig().safety_margin))


def test_the_candidate_cap_is_honoured():
    combos = list(compositions([16] * 8, 16, 256))
    assert len(combos) == 256 and len(set(combos)) == 256
    assert all(1 <= sum(c) <= 16 for c in combos)
    assert combos[0][0] > 0  # the most urgent bucket first
    sched = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(max_candidates=7))
    queue = [QueuedRequest(i, 0.0, 5.0 + i, 256 * (1 + i % 4), 32) for i in range(40)]
    assert sched.next_batch(queue, 0.0).num_candidates <= 7


def test_kv_capacity_limits_the_batch():
    sched = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(kv_capacity_tokens=3000))
    queue = [QueuedRequest(i, 0.0, 1000.0, 1000, 32) for i in range(6)]
    d = sched.next_batch(queue, 0.0)
    # a relaxed queue: all six make it two at a time, so no partial allocation
    assert len(d.request_ids) == 2 and d.kv_window_layers is None


def test_a_burst_bucket_runs_wider_under_partial_kv_allocation():
    planner = Planner(make_profile())
    cfg = SchedulerConfig(kv_capacity_tokens=3400)  # three resident; the window fits all six
    sched = SloAwareScheduler(planner, cfg)
    probe = [QueuedRequest(i, 0.0, 1.0, 1000, 32) for i in range(6)]
    floor_all, _ = sched.band(probe)
    burst = [QueuedRequest(i, 0.0, 1.02 * floor_all, 1000, 32) for i in range(6)]  # one deadline bucket
    resident = SloAwareScheduler(planner, SchedulerConfig(kv_capacity_tokens=3400, is_partial_allocation=False))
    narrow = resident.next_batch(burst, 0.0)
    assert len(narrow.request_ids) <= 3 and narrow.expected_on_time < 6  # resident: not all can make it
    d = sched.next_batch(burst, 0.0)
    assert d.kv_window_layers == sched.window_layers == max(planner.depths) + 1 < 30
    assert sched.partial_capacity == 3400 * 30 // d.kv_window_layers
    assert 2 < len(d.request_ids) <= sched.partial_capacity // 1032 and d.expected_on_time > narrow.expected_on_time
    # once the bucket fits again, the next batch runs fully resident
    assert sched.next_batch(burst[:2], 0.0).kv_window_layers is None


# the SLO is checked where a request is made (`cachesmith.request`), not again in its queue view
@pytest.mark.parametrize("kwargs, match", [({"context_tokens": -1}, "context_tokens=-1"),
                                           ({"suffix_tokens": 0}, "suffix_tokens must be >= 1")])
def test_bad_requests_are_named(kwargs, match):
    with pytest.raises(InputError, match=match):
        QueuedRequest(**{"request_id": 3, "arrival_s": 0.0, "slo_s": 1.0, "context_tokens": 10,
                         "suffix_tokens": 5, **kwargs})


def _reference_score(sched, members, live, floors, now):
    """Algorithm 1's scoring of one composition, written plainly (one band call per candidate)."""
    floor, saturation = sched.band(members)
    limit = (min(r.deadline_s for r in members) - now) * (1 - sched.config.safety_margin)
    ids = {r.request_id for r in members}
    waiting = sorted((r for r in live if r.request_id not in ids), key=lambda r: r.arrival_s)
    budget = floor if floor > limit else min(limit, saturation)
    ahead = 0.0  # the budget stops where a waiting request that makes it at the floor would miss
    for r in waiting:
        ahead += floors[r.request_id]
        if now + floor + ahead <= r.deadline_s:
            budget = max(floor, min(budget, r.deadline_s - ahead - now - 1e-9))

    def fcfs(t):
        n = 0
        for r in waiting:
            t += floors[r.request_id]
            n += t <= r.deadline_s
        return n

    queued = fcfs(now + budget)
    return sum(now + budget <= r.deadline_s for r in members) + queued


def test_vectorized_search_agrees_with_a_plain_scoring_of_every_composition():
    from cachesmith.scheduler.buckets import bucketize

    sched = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(max_batch_size=4, is_partial_allocation=False))
    rng = __import__("random").Random(11)
    for trial in range(25):
        now = 5.0
        queue = [QueuedRequest(i, now - rng.uniform(0, 3), rng.uniform(0.5, 6.0), rng.choice([300, 900, 2500]),
                               32) for i in range(rng.randint(2, 7))]
        floors = {r.request_id: sched.floor(r) for r in queue}
        live = [r for r in queue if now + floors[r.request_id] <= r.deadline_s]
        if not live:
            continue
        on_time, members, _, _ = sched._pick(sched._price(live, floors, now), sched.config.kv_capacity_tokens)
        quantum = max(min(floors[r.request_id] for r in live), 1e-3)
        buckets = bucketize(live, now, quantum, sched.config.length_edges)
        best = max(_reference_score(sched, [r for b, k in zip(buckets, combo) for r in b[:k]], live, floors, now)
                   for combo in compositions([len(b) for b in buckets], 4, 256))
        assert on_time == best, trial
        assert on_time == _reference_score(sched, members, live, floors, now)


def test_the_limit_is_the_members_deadline_or_a_waiting_requests_slack():
    sched = SloAwareScheduler(Planner(make_profile()))
    f = sched.floor(QueuedRequest(0, 0, 1, 1024, 32))
    alone = QueuedRequest(0, 0.0, 3.0 * f, 1024, 32)
    d = sched.next_batch([alone], 0.0)
    # the budget keeps the safety margin; the limit is the deadline itself
    assert d.budget_s < d.limit_s and d.limit_s == pytest.approx(alone.deadline_s)
    # one request per batch: the one behind must keep its floor before its deadline
    one = SloAwareScheduler(Planner(make_profile()), SchedulerConfig(max_batch_size=1))
    first = QueuedRequest(0, 0.0, 1.5 * f, 1024, 32)
    for slo, limit in ((2.2 * f, 1.2 * f), (4.0 * f, first.slo_s)):  # the waiting slack binds, then the deadline
        d = one.next_batch([first, QueuedRequest(1, 0.0, slo, 1024, 32)], 0.0)
        assert d.request_ids == (0,) and d.budget_s <= d.limit_s
        assert d.limit_s == pytest.approx(max(d.budget_s, limit), rel=1e-6)


def test_a_batch_shares_the_room_the_waiting_queue_leaves():
    """Pass probability is concave in coverage: when the waiting queue bounds a batch's budget, the
    batch takes its share of the room (in proportion to the band spans), not all of it while those
    behind fall to their floors."""
    def run(is_shared):
        return SloAwareScheduler(Planner(make_profile()), SchedulerConfig(max_batch_size=1, is_slack_shared=is_shared))
    floor, saturation = run(True).band([QueuedRequest(0, 0.0, 1.0, 1024, 32)])
    deadline = 1.5 * saturation
    queue = [QueuedRequest(i, 0.0, deadline, 1024, 32) for i in range(4)]  # one runs, three wait
    room = deadline - 3 * floor - 1e-9
    assert run(False).next_batch(queue, 0.0).budget_s == pytest.approx(room)
    shared = run(True).next_batch(queue, 0.0)
    assert shared.expected_on_time == 4
    assert shared.budget_s == pytest.approx(floor + (room - floor) / 4)  # four equal spans split the room
    greedy, even = ([d.budget_s for d, _ in drain(run(s), queue)] for s in (False, True))
    assert min(greedy) == pytest.approx(floor) and max(greedy) == pytest.approx(room)
    assert min(even) > floor + 0.01 and max(even) < room - 0.1  # no batch falls to its floor, none takes all
    assert drain(run(True), queue)[-1][1] <= deadline + 1e-9  # and everyone still makes it
