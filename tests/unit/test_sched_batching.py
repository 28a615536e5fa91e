"""Unit tests of the default policy, :class:`DeadlineBatching` (exact, no model, no clock).

Latencies are dyadic fractions so every expected time is exact in floating point.
"""

from __future__ import annotations

import math
import random

import pytest

from jaxserve.sched.base import Cell, CostModel, LatencyProfile, Plan, Request, ShapeGrid
from jaxserve.sched.batching import DeadlineBatching, QueueFull

INF = math.inf

# text model: batch sizes 1, 2, 4; buckets 16, 32
TEXT_GRID = ShapeGrid((1, 2, 4), (16, 32))
TEXT_SECONDS = {
    Cell(1, 16): 0.25, Cell(2, 16): 0.375, Cell(4, 16): 0.625,
    Cell(1, 32): 0.5, Cell(2, 32): 0.75, Cell(4, 32): 1.25,
}
# image model: batch sizes 1, 2, 4, 8; no buckets
IMAGE_GRID = ShapeGrid((1, 2, 4, 8))
IMAGE_SECONDS = {Cell(1): 0.25, Cell(2): 0.375, Cell(4): 0.5, Cell(8): 1.0}

COST = CostModel(
    {"bert": LatencyProfile("bert", TEXT_SECONDS), "vit": LatencyProfile("vit", IMAGE_SECONDS)}
)
GRIDS = {"bert": TEXT_GRID, "vit": IMAGE_GRID}


def policy(**kw) -> DeadlineBatching:
    kw.setdefault("max_queue", 64)
    kw.setdefault("max_wait", INF)
    return DeadlineBatching(GRIDS, COST, **kw)


def text(i, arrival, length=10, deadline=INF):
    return Request(i, arrival, "bert", length=length, deadline=deadline)


def image(i, arrival, deadline=INF):
    return Request(i, arrival, "vit", deadline=deadline)


def ids(plan: Plan) -> list[tuple[int, ...]]:
    return [b.request_ids for b in plan.batches]


# -- batch growth ------------------------------------------------------------------


def test_fills_batch_to_max_size_under_a_flood():
    p = policy(max_wait=1.0)
    for i in range(3):
        p.on_arrival(image(i, 0.0), 0.0)
        plan = p.plan(0.0, [0])
        assert plan.batches == () and plan.wake_at == 1.0  # wait for more (max_wait)
    for i in range(3, 20):
        p.on_arrival(image(i, 0.0), 0.0)
    plan = p.plan(0.0, [5, 2, 7])
    assert ids(plan) == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert [b.cell for b in plan.batches] == [Cell(8), Cell(8)]
    assert [b.instance for b in plan.batches] == [5, 2]  # in the caller's order
    assert p.queue_depth() == 4
    # the 4 left are a partial batch: they wait for max_wait from the oldest
    assert plan.wake_at == 1.0
    # with no idle instance there is nothing to wake for (no deadline to evict by)
    assert p.plan(0.5, []).wake_at == INF
    plan = p.plan(1.0, [0])
    assert ids(plan) == [(16, 17, 18, 19)] and plan.batches[0].cell == Cell(4)
    assert p.queue_depth() == 0 and p.plan(1.0, [0]).wake_at == INF


def test_dispatches_partial_batch_when_oldest_slack_runs_out():
    p = policy()  # no max_wait cap: only deadlines make it leave early
    p.on_arrival(text(0, 0.0, deadline=2.0), 0.0)
    assert p.plan(0.0, [0]).wake_at == 2.0 - 0.25  # alone: L(1, 16)
    p.on_arrival(text(1, 0.5, deadline=3.0), 0.5)
    assert p.plan(0.5, [0]).wake_at == 2.0 - 0.375  # two: L(2, 16)
    p.on_arrival(text(2, 0.75, deadline=3.0), 0.75)
    plan = p.plan(0.75, [0])
    assert plan.batches == () and plan.wake_at == 2.0 - 0.625  # three pad to cell 4
    assert p.plan(1.25, [0]).batches == ()  # just before: still waiting
    plan = p.plan(1.375, [0])
    assert ids(plan) == [(0, 1, 2)] and plan.batches[0].cell == Cell(4, 16)
    assert plan.evict == () and plan.wake_at == INF


def test_no_deadline_waits_max_wait_from_the_oldest():
    p = policy(max_wait=0.5)
    p.on_arrival(image(0, 1.0), 1.0)
    p.on_arrival(image(1, 1.25), 1.25)
    plan = p.plan(1.25, [3])
    assert plan.batches == () and plan.wake_at == 1.5
    plan = p.plan(1.5, [3])
    assert ids(plan) == [(0, 1)] and plan.batches[0] .instance == 3 and plan.batches[0].cell == Cell(2)


def test_max_wait_caps_the_wait_even_with_a_far_deadline():
    p = policy(max_wait=0.125)
    p.on_arrival(image(0, 0.0, deadline=100.0), 0.0)
    assert p.plan(0.0, [0]).wake_at == 0.125


def test_arrival_that_makes_the_batch_too_slow_shrinks_it():
    p = policy()
    for i in range(4):
        p.on_arrival(image(i, 0.0, deadline=1.0), 0.0)
    assert p.plan(0.0, [0]).wake_at == 1.0 - 0.5  # four: cell 4 takes 0.5
    # at 0.25 a fifth arrives: cell 8 (1.0 s) can no longer make deadline 1.0,
    # but cell 4 still can, so the four leave now and the fifth waits.
    p.on_arrival(image(4, 0.25, deadline=5.0), 0.25)
    plan = p.plan(0.25, [0])
    assert ids(plan) == [(0, 1, 2, 3)] and plan.batches[0].cell == Cell(4)
    assert p.queue_depth() == 1


# -- buckets -----------------------------------------------------------------------


def test_groups_by_bucket_and_fills_free_rows_from_smaller_buckets_only():
    p = policy()
    # three long requests (bucket 32) and two short (bucket 16)
    for i, length in enumerate([30, 20, 8, 31, 12]):
        p.on_arrival(text(i, 0.0, length=length, deadline=10.0), 0.0)
    plan = p.plan(0.0, [0, 1])
    assert plan.batches == () and plan.wake_at == 10.0 - 1.25  # the long three, in cell (4, 32)
    plan = p.plan(8.75, [0, 1])
    # bucket 32 takes its three and fills its one free row with the most urgent
    # short request; the other short one is not due yet (10 - L(1, 16)).
    assert ids(plan) == [(0, 1, 3, 2)] and plan.batches[0].cell == Cell(4, 32)
    assert plan.wake_at == 10.0 - 0.25
    plan = p.plan(9.75, [1])
    assert ids(plan) == [(4,)] and plan.batches[0].cell == Cell(1, 16)


def test_short_batch_never_takes_a_long_request():
    p = policy()
    p.on_arrival(text(0, 0.0, length=5, deadline=1.0), 0.0)
    p.on_arrival(text(1, 0.0, length=25, deadline=10.0), 0.0)
    plan = p.plan(0.75, [0])
    assert ids(plan) == [(0,)] and plan.batches[0].cell == Cell(1, 16)


def test_filler_that_would_miss_its_deadline_is_not_taken():
    p = policy()
    for i in range(3):
        p.on_arrival(text(i, 0.0, length=30, deadline=10.0), 0.0)
    p.on_arrival(text(3, 0.0, length=4, deadline=9.5), 0.0)  # 8.75 + 1.25 > 9.5
    plan = p.plan(8.75, [0])
    assert ids(plan)[0] == (0, 1, 2)
    assert p.queue_depth() == 1


def _long_head_and_shorts(p, shorts=2, long_deadline=INF, short_deadline=INF):
    """A bucket-32 request at t=0 (the most urgent queue) and ``shorts`` bucket-16 ones at t=0.125."""
    p.on_arrival(text(0, 0.0, length=30, deadline=long_deadline), 0.0)
    for i in range(1, shorts + 1):
        p.on_arrival(text(i, 0.125, length=8, deadline=short_deadline), 0.125)


def test_merges_smaller_buckets_into_a_larger_cell_when_that_costs_no_more_than_their_own_batch():
    p = policy(max_wait=0.0)
    _long_head_and_shorts(p, shorts=2)
    plan = p.plan(0.125, [0])
    # (1, 32) -> (2, 32) adds 0.25 s = L(1, 16): taken. (2, 32) -> (4, 32) would add 0.5 s
    # for the one short left, which alone costs 0.25 s in (1, 16): not taken.
    assert ids(plan) == [(0, 1)] and plan.batches[0].cell == Cell(2, 32)
    assert p.queue_depth() == 1


def test_never_merges_when_the_larger_cell_costs_more_than_the_separate_batch():
    linear = {Cell(b, s): b * s / 64 for b in (1, 2, 4) for s in (16, 32)}  # no per-call overhead
    p = DeadlineBatching({"bert": TEXT_GRID}, CostModel({"bert": LatencyProfile("bert", linear)}), max_wait=0.0)
    _long_head_and_shorts(p, shorts=3)
    plan = p.plan(0.125, [0])
    assert ids(plan) == [(0,)] and plan.batches[0].cell == Cell(1, 32)
    assert p.queue_depth() == 3


@pytest.mark.parametrize("who", ["head", "donor"])
def test_never_merges_when_the_larger_cell_would_miss_a_deadline(who):
    p = policy(max_wait=0.0)
    # the larger cell (2, 32) ends at 0.125 + 0.75 = 0.875
    if who == "head":
        _long_head_and_shorts(p, shorts=1, long_deadline=0.75)  # alone in (1, 32) it ends at 0.625
    else:
        _long_head_and_shorts(p, shorts=1, short_deadline=0.8)
    plan = p.plan(0.125, [0])
    assert ids(plan) == [(0,)] and plan.batches[0].cell == Cell(1, 32)


def test_length_beyond_the_largest_bucket_is_refused():
    p = policy()
    with pytest.raises(ValueError):
        p.on_arrival(text(0, 0.0, length=33), 0.0)
    assert p.queue_depth() == 0


# -- eviction and overload --------------------------------------------------------------


def test_evicts_a_request_that_cannot_meet_its_deadline_even_alone():
    p = policy()
    p.on_arrival(image(0, 0.0, deadline=0.125), 0.0)  # L(1) = 0.25 > 0.125
    p.on_arrival(image(1, 0.0, deadline=4.0), 0.0)
    plan = p.plan(0.0, [0])
    assert plan.evict == (0,) and plan.batches == ()
    assert p.queue_depth() == 1


def test_with_every_instance_busy_wakes_exactly_when_the_head_turns_unmeetable():
    p = policy()
    p.on_arrival(image(0, 0.0, deadline=2.0), 0.0)
    plan = p.plan(0.0, [])
    assert plan.batches == () and plan.evict == ()
    assert plan.wake_at == math.nextafter(2.0 - 0.25, INF)
    assert p.plan(1.75, []).evict == ()  # can still just make it
    plan = p.plan(plan.wake_at, [])
    assert plan.evict == (0,) and plan.wake_at == INF


def test_under_overload_serves_a_full_later_window_rather_than_shrinking():
    p = policy()
    # a backlog: 2 requests whose deadlines only a batch of 1-2 can make, then 8 more
    p.on_arrival(image(0, 0.0, deadline=1.375), 0.0)
    p.on_arrival(image(1, 0.0, deadline=1.375), 0.0)
    for i in range(2, 10):
        p.on_arrival(image(i, 0.0, deadline=3.0), 0.0)
    plan = p.plan(1.0, [0])
    # shrinking would serve 2 requests in 0.375 s (5.3/s); the window 2..9 serves
    # 8 in 1.0 s (8/s) and still makes their deadline 3.0.
    assert ids(plan) == [tuple(range(2, 10))] and plan.batches[0].cell == Cell(8)
    assert p.queue_depth() == 2  # 0 and 1 stay queued: not evicted while feasible
    plan = p.plan(1.0, [1])
    assert ids(plan) == [(0, 1)]


def test_shrinks_rather_than_drops_when_that_serves_as_many_per_second():
    p = policy()
    p.on_arrival(image(0, 0.0, deadline=1.5), 0.0)
    for i in range(1, 5):
        p.on_arrival(image(i, 0.0, deadline=1.5 + 0.0625 * i), 0.0)
    # at 1.0 a batch of 5 (cell 8, 1.0 s) misses 1.5; cell 4 (0.5 s) makes it.
    # Dropping the head would also serve 4 in cell 4: a tie keeps the head.
    plan = p.plan(1.0, [0])
    assert ids(plan) == [(0, 1, 2, 3)]


# -- admission ---------------------------------------------------------------------


def test_respects_the_bounded_queue_per_model():
    p = policy(max_queue=3, max_wait=1.0)
    for i in range(3):
        assert p.admits("vit")
        p.on_arrival(image(i, 0.0), 0.0)
    assert not p.admits("vit") and p.admits("bert")
    with pytest.raises(QueueFull):
        p.on_arrival(image(3, 0.0), 0.0)
    assert p.queue_depth() == 3 and p.queue_depth("vit") == 3 and p.queue_depth("bert") == 0
    p.on_arrival(text(4, 0.0), 0.0)
    assert p.queue_depth() == 4
    plan = p.plan(100.0, [0, 1])
    assert sorted(len(b.request_ids) for b in plan.batches) == [1, 3]
    assert p.admits("vit") and p.queue_depth() == 0


def test_unknown_model_is_an_error():
    p = policy()
    with pytest.raises(KeyError):
        p.on_arrival(Request(0, 0.0, "gpt"), 0.0)


def test_missing_cell_price_is_an_error_at_construction():
    partial = CostModel({"vit": LatencyProfile("vit", {Cell(1): 0.1})})
    with pytest.raises(KeyError):
        DeadlineBatching({"bert": TEXT_GRID}, partial)


# -- invariants under random traffic ----------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_invariants(seed):
    """Never a busy instance, never a lost or duplicated request, wake_at always ahead."""
    rng = random.Random(seed)
    p = policy(max_queue=20, max_wait=rng.choice([0.0, 0.125, 2.0]))
    instances = 3
    busy_until: dict[int, float] = {}
    seen: list[int] = []
    admitted = 0
    now = 0.0
    next_id = 0
    for _ in range(600):
        now += rng.choice([0.0, 0.0625, 0.125, 0.5])
        for inst in [i for i, t in busy_until.items() if t <= now]:
            del busy_until[inst]
        model = rng.choice(["bert", "vit"])
        if p.admits(model):
            deadline = now + rng.choice([0.125, 0.75, 1.5, 4.0, INF])
            length = rng.randint(1, 32)
            req = text(next_id, now, length, deadline) if model == "bert" else image(next_id, now, deadline)
            p.on_arrival(req, now)
            admitted += 1
            next_id += 1
        assert p.queue_depth("bert") <= 20 and p.queue_depth("vit") <= 20
        idle = [i for i in range(instances) if i not in busy_until]
        rng.shuffle(idle)
        plan = p.plan(now, idle)
        assert plan.wake_at > now
        used = [b.instance for b in plan.batches]
        assert len(set(used)) == len(used) and set(used) <= set(idle)
        for b in plan.batches:
            assert 1 <= len(b.request_ids) <= b.cell.batch
            assert b.cell in GRIDS[b.model].cells()
            busy_until[b.instance] = now + COST.latency[b.model].latency(b.cell)
            seen.extend(b.request_ids)
        seen.extend(plan.evict)
    # drain: every instance idle, far in the future
    for _ in range(100):
        if not p.queue_depth():
            break
        now += 10.0
        plan = p.plan(now, list(range(instances)))
        for b in plan.batches:
            seen.extend(b.request_ids)
        seen.extend(plan.evict)
    assert p.queue_depth() == 0
    assert sorted(seen) == list(range(admitted))


def test_with_instances_always_idle_every_batch_meets_every_deadline_and_none_is_evicted():
    rng = random.Random(7)
    p = policy(max_wait=0.25)
    deadline_of = {}
    served = []
    wake = INF
    now = 0.0

    def run_plan(t):
        plan = p.plan(t, [0, 1, 2, 3])  # plenty of instances
        assert plan.evict == ()
        for b in plan.batches:
            finish = t + IMAGE_SECONDS[b.cell]
            assert all(finish <= deadline_of[r] for r in b.request_ids)
            served.extend(b.request_ids)
        return plan.wake_at

    for i in range(400):
        now += rng.choice([0.0, 0.03125, 0.25])
        while wake <= now:
            wake = run_plan(wake)
        deadline_of[i] = now + rng.choice([0.5, 1.0, 2.0, 3.0])
        p.on_arrival(image(i, now, deadline_of[i]), now)
        wake = run_plan(now)
    while wake < INF:
        wake = run_plan(wake)
    assert sorted(served) == list(range(400))


def test_is_a_policy_whose_optional_hooks_answer_as_the_base_class_says():
    from jaxserve.sched.base import Policy, StepSummary

    p = policy(max_wait=0.0, max_queue=1)
    assert isinstance(p, Policy)
    assert p.admits("bert") is True
    p.on_arrival(text(0, 0.0), 0.0)
    assert p.admits("bert") is False  # its own bound, not "no opinion"
    (batch,) = p.plan(0.0, [0]).batches
    assert p.service_time(batch) is None and p.describe_request(0) == {} and list(p.metrics()) == []
    p.on_completion(batch, 0.25, {0: StepSummary(0.9, "x")})  # the engine hands over summaries
    assert p.queue_depth() == 0 and p.admits("bert") is True
