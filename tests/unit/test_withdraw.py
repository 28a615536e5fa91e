"""Policy.withdraw, for every policy the server can run: a request whose client went away
while it was queued is forgotten (never dispatched, never evicted), anything else is
refused, and nothing else is lost or served twice.

Each policy is driven by a small discrete-event loop with a fake clock through a stressed
stream (bursts above capacity, deadlines), with withdrawal attempts at random moments,
including for requests already running or answered.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest

from jaxserve.sched import baselines
from jaxserve.sched.arlo import ArloPolicy
from jaxserve.sched.base import AccuracyProfile, Cell, CostModel, LatencyProfile, Request, ShapeGrid
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.sched.otas import INFaaSPolicy, ModelVariant, OTASPolicy

BUCKETS = (64, 128, 256)
TEXT_GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=BUCKETS)
TEXT = LatencyProfile("bert", {Cell(b, s): 0.002 * (1 + s / 64) * (1 + 0.5 * (b - 1))
                               for s in BUCKETS for b in (1, 2, 4)})
GAMMAS = (-10, 0, 8)
IMAGE_GRID = ShapeGrid(batch_sizes=(1, 4, 8), gammas=GAMMAS)
IMAGE = LatencyProfile("vit", {Cell(b, 0, g): (1 + g / 20) * (0.004 + 0.002 * b)
                               for b in (1, 4, 8) for g in GAMMAS})
ACCURACY = AccuracyProfile("vit", {("c10", g): 0.9 + g / 100 for g in GAMMAS})


def _variants():
    grid = ShapeGrid(batch_sizes=(1, 4, 8), gammas=(0,))
    return [ModelVariant(name, LatencyProfile(name, {Cell(b, 0, 0): k * (0.004 + 0.002 * b) for b in (1, 4, 8)}),
                         AccuracyProfile(name, {("c10", 0): acc}), grid)
            for name, k, acc in (("vit-s", 0.5, 0.85), ("vit-b", 1.0, 0.93))]


POLICIES = {
    "default": lambda: DeadlineBatching({"bert": TEXT_GRID}, CostModel({"bert": TEXT}), max_queue=10_000,
                                        max_wait=0.004),
    "arlo": lambda: ArloPolicy("bert", TEXT_GRID, TEXT, slo=0.1, instances=3, period=0.5, warmup=0.2,
                               max_batch=2),
    "st": lambda: baselines.StaticPaddingPolicy("bert", TEXT_GRID, TEXT, 0.1, 3),
    "dt": lambda: baselines.DynamicShapePolicy("bert", TEXT_GRID, TEXT, 0.1, 3),
    "infaas-text": lambda: baselines.InfaasLikePolicy("bert", TEXT_GRID, TEXT, 0.1, 3, interval=0.5, window=1.0),
    "otas": lambda: OTASPolicy("vit", IMAGE, ACCURACY, IMAGE_GRID),
    "infaas-image": lambda: INFaaSPolicy(_variants(), switch_seconds=0.05, decision_interval=0.3),
}
IMAGE_POLICIES = {"otas", "infaas-image"}


def _instances(policy) -> list[int]:
    dispatcher = getattr(policy, "dispatcher", None)
    return sorted(dispatcher.instances()) if dispatcher is not None else [0, 1, 2]


def _stream(image: bool, rng: random.Random, n: int):
    t = 0.0
    for i in range(n):
        t += rng.expovariate(900.0 if (t % 1.0) > 0.6 else 150.0)
        deadline = t + rng.choice((0.05, 0.2, math.inf)) if not image else t + rng.choice((0.05, 0.3))
        if image:
            yield Request(i, t, "vit", task="c10", deadline=deadline)
        else:
            yield Request(i, t, "bert", length=rng.randint(1, 256), deadline=deadline)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_withdrawn_requests_are_forgotten_and_nothing_else_is_lost(name):
    rng = random.Random(7)
    policy = POLICIES[name]()
    requests = list(_stream(name in IMAGE_POLICIES, rng, 1500))
    events: list = []
    seq = itertools.count()
    for r in requests:
        heapq.heappush(events, (r.arrival, next(seq), "arrive", r))
        if rng.random() < 0.3:  # a client that gives up after a while (some after their answer)
            heapq.heappush(events, (r.arrival + rng.uniform(0, 0.05), next(seq), "withdraw", r.id))
    queued: set[int] = set()
    dispatched: list[int] = []
    evicted: list[int] = []
    withdrawn: list[int] = []
    refused = 0
    busy: dict[int, object] = {}
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrive":
            policy.on_arrival(item, now)
            queued.add(item.id)
        elif kind == "withdraw":
            took = policy.withdraw(item, now)
            assert took == (item in queued), (item, took)
            if took:
                queued.discard(item)
                withdrawn.append(item)
            else:
                refused += 1
            assert not policy.withdraw(item, now)  # never twice
        elif kind == "done":
            del busy[item.instance]
            policy.on_completion(item, now)
        idle = [i for i in _instances(policy) if i not in busy]
        plan = policy.plan(now, idle)
        for rid in plan.evict:
            assert rid in queued, f"evicted {rid}, which is not queued"
            queued.discard(rid)
            evicted.append(rid)
        for b in plan.batches:
            assert b.instance in idle
            for rid in b.request_ids:
                assert rid in queued, f"dispatched {rid}, which is not queued"
                queued.discard(rid)
                dispatched.append(rid)
            busy[b.instance] = b
            heapq.heappush(events, (now + 0.01 + 0.004 * len(b.request_ids), next(seq), "done", b))
        if plan.wake_at < math.inf:
            heapq.heappush(events, (max(plan.wake_at, now), next(seq), "wake", None))
        assert policy.queue_depth() == len(queued)
    assert not queued and policy.queue_depth() == 0
    assert sorted(dispatched + evicted + withdrawn) == [r.id for r in requests]  # each exactly once
    assert len(withdrawn) > 20 and refused > 20  # both sides of the contract were exercised
    assert not policy.withdraw(10**9, now)  # never seen
    if isinstance(policy, ArloPolicy):
        assert all(load == 0 for load in policy.dispatcher.loads().values())
        assert policy.counters.withdrawn == len(withdrawn)


def test_otas_withdrawing_a_batch_s_only_request_leaves_no_empty_batch_behind():
    p = POLICIES["otas"]()
    p.on_arrival(Request(0, 0.0, "vit", task="c10", deadline=1.0), 0.0)
    assert p.withdraw(0, 0.001)
    p.on_arrival(Request(1, 0.002, "vit", task="c10", deadline=1.0), 0.002)  # no batch to join
    assert p.queued_batches() == ((1,),) and p.counters["withdrawn"] == 1
