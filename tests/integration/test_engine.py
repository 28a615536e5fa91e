"""The engine with real executables: failures, restarts, draining, exactly one answer each."""

import asyncio
import logging
import math

import numpy as np
import pytest

from jaxserve.engine import Answer, Draining, Engine, ExecutionFailed, Item, Overloaded, TooManyItems
from jaxserve.models.bert import BERT_CONFIGS, BertConfig, init_bert
from jaxserve.polymorph import PolymorphTable
from jaxserve.runtime import TextRuntime
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.servables import bert_servable, weights_of
from serving.metrics import _price_metrics

GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16,))
CFG = BERT_CONFIGS["bert-tiny-test"]


@pytest.fixture(scope="module")
def table():
    t = PolymorphTable(bert_servable("tiny", CFG, GRID))
    t.warmup()
    return t


def make_engine(table, weights, instances=1, max_queue=64, **kw):
    rt = TextRuntime("tiny", table, weights)
    cost = CostModel({"tiny": LatencyProfile("tiny", {c: 0.002 * c.batch for c in GRID.cells()})})
    policy = DeadlineBatching({"tiny": GRID}, cost, max_queue=max_queue)
    return Engine({"tiny": rt}, policy, instances=instances, max_queue=max_queue, **kw)


def items(n, slo_ms=None):
    return [Item("tiny", [101, 5 + i, 102], 3, "", slo_ms) for i in range(n)]


def test_failed_batch_is_retried_then_answered_with_error_and_worker_restarted(table):
    wrong = weights_of(init_bert(BertConfig(**{**CFG.__dict__, "intermediate_size": 48})))
    good = weights_of(init_bert(CFG))

    async def scenario():
        engine = make_engine(table, wrong)
        results = await asyncio.gather(*engine.submit(items(3)), return_exceptions=True)
        assert all(isinstance(r, ExecutionFailed) for r in results)
        assert engine.stats.retries >= 1 and engine.stats.worker_restarts >= 1
        # the engine keeps serving once the fault is gone
        engine.runtimes["tiny"].weights = good
        ok = await asyncio.gather(*engine.submit(items(2)))
        assert [a.outcome for a in ok] == ["ok", "ok"]
        assert engine.in_flight == 0
        engine.close()

    asyncio.run(scenario())


def test_drain_finishes_accepted_work_then_refuses_new(table):
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)), instances=2)
        futures = engine.submit(items(10))
        drained = await engine.drain(timeout_s=30)
        assert drained and all(f.done() for f in futures)
        assert all(isinstance(f.result(), Answer) for f in futures)
        with pytest.raises(Draining):
            engine.submit(items(1))
        engine.close()

    asyncio.run(scenario())


def test_admission_is_all_or_nothing(table):
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)), max_queue=5)
        first = engine.submit(items(4))  # a full batch: dispatched at once to the one instance
        second = engine.submit(items(4))  # waits in the queue (4 of 5)
        assert engine.queue_depth == 4
        with pytest.raises(Overloaded) as exc:
            engine.submit(items(3))  # 4 + 3 > 5: refused whole, nothing of it queued
        assert exc.value.retry_after_s > 0
        assert engine.queue_depth == 4
        answers = await asyncio.gather(*first, *second)
        assert len(answers) == 8
        engine.close()

    asyncio.run(scenario())


def test_retry_after_is_the_time_the_queue_takes_to_drain(table):
    """A refused request is told to come back when the items queued now will have left the
    queue, at the rate items left it recently: 4 queued, 4 dispatched over the 2 s since
    the engine got busy (2 per s) -> 2 s. On an injected clock, so exact."""
    t = [0.0]

    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)), max_queue=5, clock=lambda: t[0])
        first = engine.submit(items(4))  # a full batch: dispatched at t = 0
        second = engine.submit(items(4))  # waits for the one instance
        t[0] = 2.0
        await asyncio.gather(*first)  # second dispatched at t = 2: 8 items left the queue in 2 busy s
        queued = engine.submit(items(4))  # the instance is busy: these wait
        assert engine.queue_depth == 4
        with pytest.raises(Overloaded) as exc:
            engine.submit(items(2))
        assert exc.value.retry_after_s == pytest.approx(4 / (8 / 2.0))
        t[0] = 10.0  # nothing left the queue in the last 5 s: back to the cautious default
        with pytest.raises(Overloaded) as exc:
            engine.submit(items(2))
        assert exc.value.retry_after_s == pytest.approx(0.04)
        await asyncio.gather(*second, *queued)
        # idle until t = 100, then a burst: its rate is measured over the 0.5 s it has been busy,
        # not over the last 5 s, most of them quiet (4 left in 0.5 s -> 8/s -> 0.5 s for 4)
        t[0] = 100.0
        burst = engine.submit(items(4))
        t[0] = 100.5
        waiting = engine.submit(items(4))
        with pytest.raises(Overloaded) as exc:
            engine.submit(items(2))
        assert exc.value.retry_after_s == pytest.approx(4 / (4 / 0.5))
        await asyncio.gather(*burst, *waiting)
        engine.close()

    asyncio.run(scenario())


def test_each_item_answered_exactly_once_with_mixed_deadlines(table):
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)))
        futures = []
        for k in range(40):
            futures += engine.submit(items(1, slo_ms=0.0001 if k % 3 == 0 else 10_000))
        answers = await asyncio.gather(*futures)
        outcomes = [a.outcome for a in answers]
        assert len(answers) == 40
        assert outcomes.count("evicted") >= 1 and outcomes.count("ok") >= 1
        assert sum(engine.stats.outcomes.values()) == 40
        assert all(a.outputs == {} for a in answers if a.outcome == "evicted")
        assert all(np.isfinite(a.outputs["embedding"]).all() for a in answers if a.outcome == "ok")
        # latency_ms runs from the arrival stamp to the answer: it covers queue and compute
        # (and the hand-off back to the loop); an evicted item only ever waited
        for a in answers:
            assert a.latency_ms >= a.queue_ms + a.compute_ms - 1e-6
            if a.outcome == "evicted":
                assert a.latency_ms == a.queue_ms and a.compute_ms == 0
        engine.close()

    asyncio.run(scenario())


def test_a_server_default_deadline_covers_items_that_carry_none(table):
    """With default_slo_ms, an item without its own slo_ms gets that deadline (and is
    evicted when it cannot make it); an item's own slo_ms still wins. Without the
    default, the same items have no deadline and all run."""
    async def scenario(default):
        engine = make_engine(table, weights_of(init_bert(CFG)), default_slo_ms=default)
        first = engine.submit(items(4))  # a full batch: the only instance is busy with it
        mine = engine.submit(items(2, slo_ms=60_000))
        bare = engine.submit(items(2))  # stamped after the first batch started
        got = await asyncio.gather(*first, *mine, *bare)
        engine.close()
        return [a.outcome for a in got[4:6]], [a.outcome for a in got[6:]]

    own, bare = asyncio.run(scenario(0.0001))
    assert own == ["ok", "ok"] and bare == ["evicted", "evicted"]
    own, bare = asyncio.run(scenario(None))
    assert own == ["ok", "ok"] and bare == ["ok", "ok"]
    for bad in (0, -5, math.nan, math.inf):
        with pytest.raises(ValueError, match="default_slo_ms"):
            make_engine(table, weights_of(init_bert(CFG)), default_slo_ms=bad)


def test_withdrawn_items_never_run_and_the_rest_are_answered(table):
    """A client that leaves: its queued items are taken back before they run (their futures
    cancelled, outcome ``withdrawn``); items already running finish; a later submission is
    served as usual, and draining does not wait for the withdrawn ones."""
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)))
        running = engine.submit(items(4))  # a full batch: on the one instance at once
        queued = engine.submit(items(3))  # waits behind it
        assert engine.queue_depth == 3
        assert engine.withdraw(running + queued) == 3  # the running four cannot be taken back
        assert all(f.cancelled() for f in queued) and engine.queue_depth == 0
        assert engine.withdraw(queued) == 0  # nothing twice
        later = engine.submit(items(2))
        answers = await asyncio.gather(*running, *later)
        assert [a.outcome for a in answers] == ["ok"] * 6
        assert engine.stats.outcomes["withdrawn"] == 3
        assert engine.stats.batches == 2  # the withdrawn three never formed a batch
        assert await engine.drain(timeout_s=30) and engine.in_flight == 0
        engine.close()

    asyncio.run(scenario())


def test_a_request_larger_than_the_queue_is_refused_for_good_not_asked_to_retry(table):
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)), max_queue=5)
        with pytest.raises(TooManyItems, match="6 items in one request; this server queues at most 5"):
            engine.submit(items(6))
        assert engine.queue_depth == 0
        engine.close()

    asyncio.run(scenario())


def test_a_request_refused_by_the_policy_leaves_nothing_of_itself_queued(table):
    """The policy refuses the third item (longer than every bucket) after taking the first two:
    the request fails as a whole, and those two are taken back, not left to run for nobody
    and to hold queue places (and a drain) for ever."""
    async def scenario():
        engine = make_engine(table, weights_of(init_bert(CFG)))
        blocker = engine.submit(items(4))  # a full batch keeps the one instance busy meanwhile
        refused = items(2) + [Item("tiny", list(range(101, 131)), 30, "", None)]
        with pytest.raises(ValueError, match="does not fit the buckets"):
            engine.submit(refused)
        assert engine.queue_depth == 0 and engine.stats.outcomes["withdrawn"] == 0
        assert len(await asyncio.gather(*blocker)) == 4
        assert await engine.drain(timeout_s=5)
        assert engine.stats.outcomes["ok"] == 4  # the refused request's items never ran
        engine.close()

    asyncio.run(scenario())


def test_measured_prices_reach_the_policy_and_a_far_off_profile_is_warned_about(table, caplog):
    """A profile pricing every cell at 1 us (no executable of this model runs that fast): after
    the first steps the engine measures the real ratio, hands the policy the corrected prices
    (Policy.reprice), logs a warning once, and /metrics shows the ratio; with correct_prices off
    it measures and warns but the policy keeps the profile."""
    one_us = CostModel({"tiny": LatencyProfile("tiny", {c: 1e-6 for c in GRID.cells()})})
    weights = weights_of(init_bert(CFG))

    class Observed(DeadlineBatching):  # records what the engine hands Policy.observe_step
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.observed = []

        def observe_step(self, batch, compute_s, wall_s, now):
            self.observed.append((batch.cell, compute_s, wall_s))

    async def scenario(correct: bool):
        policy = Observed({"tiny": GRID}, one_us, max_queue=64)
        engine = Engine({"tiny": TextRuntime("tiny", table, weights)}, policy, cost_model=one_us,
                        correct_prices=correct)
        for _ in range(12):  # one at a time: 12 steps of the (1, 16) cell
            assert [a.outcome for a in await asyncio.gather(*engine.submit(items(1)))] == ["ok"]
        engine.close()
        return engine, policy

    cell = Cell(1, 16)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        engine, policy = asyncio.run(scenario(True))
    ratio = engine.drift.ratio("tiny", cell)
    assert ratio > 10
    assert engine.drift.reprices >= 1 and policy.cost_model is not one_us
    # pushed whenever the ratio moved by more than 5 %: the policy's price is within 5 % of the measured one
    assert policy.cost_model.latency["tiny"].latency(cell) == pytest.approx(1e-6 * ratio, rel=0.051)
    # every step's times reach observe_step too: the worker's compute within the engine's wall
    assert len(policy.observed) == 12
    assert all(c == cell and 0 < compute <= wall for c, compute, wall in policy.observed)
    warnings = [r for r in caplog.records if "its profiled prices" in r.getMessage()]
    assert len(warnings) == 1 and "jaxserve profile" in warnings[0].getMessage()
    families = {f.name: f for f in _price_metrics(engine)}
    assert families["jaxserve_price_ratio"].samples[0].value == pytest.approx(engine.drift.model_ratio("tiny"))
    by_cell = {s.labels["cell"]: s.value for s in families["jaxserve_price_ratio_cell"].samples}
    assert by_cell[cell.label()] == pytest.approx(ratio)

    engine, policy = asyncio.run(scenario(False))
    assert engine.drift.ratio("tiny", cell) > 10
    assert engine.drift.reprices == 0 and policy.cost_model is one_us and policy.observed == []
