"""The discrete-event simulator: exact hand-computed runs, conservation, low-load sanity."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from jaxserve.sched.base import (Batch, Cell, CostModel, IdleInstances, LatencyProfile, Plan, Policy, Request,
                                 ShapeGrid)
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import ABANDONED, EVICTED, LATE, OK, OUTCOMES, REJECTED, WITHDRAWN, simulate
from jaxserve.traces import make_trace, merge_traces, poisson_arrivals, sample_lengths

INF = math.inf

# a tiny image model: batch of 1 takes 1 s, batch of 2 takes 1.5 s
TINY_GRID = {"vit": ShapeGrid((1, 2))}
TINY_COST = CostModel({"vit": LatencyProfile("vit", {Cell(1): 1.0, Cell(2): 1.5})})


def test_hand_computed_run_is_exact():
    # r0 waits for company; r1 fills the batch (max 2) so both start at 0.25 and end
    # at 1.75. r2 (deadline 3.25) must start by 3.25 - 1.0 = 2.25, before its max_wait
    # (2.5) ends, and finishes exactly on its deadline. r3 cannot make 3.0 even alone
    # (2.5 + 1.0): evicted on arrival. r4 (no deadline) arrives while the instance is
    # busy; its max_wait ends at 3.0 but it can only start when r2's batch ends.
    trace = make_trace(
        [0.0, 0.25, 2.0, 2.5, 2.5], model="vit", slo_s=[INF, INF, 1.25, 0.5, INF]
    )
    policy = DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10, max_wait=0.5)
    r = simulate(policy, trace, TINY_COST, instances=1)
    assert r.start[[0, 1, 2, 4]].tolist() == [0.25, 0.25, 2.25, 3.25]
    assert np.isnan(r.start[3])
    assert r.finish.tolist() == [1.75, 1.75, 3.25, 2.5, 4.25]
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "ok", "ok", "evicted", "ok"]
    assert r.cell_batch.tolist() == [2, 2, 1, 0, 1]
    assert r.batch.tolist() == [0, 0, 1, -1, 2]
    assert r.batch_start.tolist() == [0.25, 2.25, 3.25]
    assert r.batch_count.tolist() == [2, 1, 1]
    assert r.latencies().tolist() == [1.75, 1.5, 1.25, 1.75]
    assert r.queue_times().tolist() == [0.25, 0.0, 0.25, 0.75]
    assert r.mean_batch_size() == pytest.approx(4 / 3)
    assert r.outcome_counts() == {"ok": 4, "late": 0, "evicted": 1, "rejected": 0, "withdrawn": 0, "abandoned": 0}
    assert r.slo_attainment() == 0.8
    assert r.span() == 4.25 and r.throughput() == 4 / 4.25
    assert r.utilization() == pytest.approx(3.5 / 4.25)


class _NoWithdraw:
    """A policy as one that keeps ``Policy.withdraw``'s default (never takes a request back)
    would behave."""

    def __init__(self, policy):
        self._policy = policy

    def withdraw(self, request_id, now):
        return False

    def __getattr__(self, name):
        return getattr(self._policy, name)


def test_impatient_clients_hand_computed():
    # One instance, no deadlines, max_wait 0; clients leave 1.2 s after sending. r0 runs
    # alone 0 -> 1.0 (answered in time). r1, r2, r3 queue; at 1.0 the batch (r1, r2) runs
    # to 2.5, after both clients left (1.3, 1.4): abandoned. r3's client leaves at 1.5 while
    # it is queued: withdrawn, never run. r4 (2.4) runs alone 2.5 -> 3.5, before its client
    # leaves at 3.6. Without withdraw, r3 stays queued and runs with r4 (2.5 -> 4.0): both
    # answers come after their clients left.
    trace = make_trace([0.0, 0.1, 0.2, 0.3, 2.4], model="vit")
    r = simulate(DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10, max_wait=0.0), trace, TINY_COST,
                 instances=1, client_timeout=1.2)
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "abandoned", "abandoned", "withdrawn", "ok"]
    assert r.finish.tolist() == [1.0, 2.5, 2.5, 1.5, 3.5]
    assert r.computed().tolist() == [True, True, True, False, True]
    assert r.completed().tolist() == [True, False, False, False, True]
    assert r.batch_count.tolist() == [1, 2, 1]
    kept = simulate(_NoWithdraw(DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10, max_wait=0.0)), trace,
                    TINY_COST, instances=1, client_timeout=1.2)
    assert [OUTCOMES[o] for o in kept.outcome] == ["ok", "abandoned", "abandoned", "abandoned", "abandoned"]
    assert kept.finish.tolist() == [1.0, 2.5, 2.5, 4.0, 4.0]
    ablation = simulate(DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10, max_wait=0.0), trace, TINY_COST,
                        instances=1, client_timeout=1.2, withdraw_when_clients_leave=False)
    assert ablation.finish.tolist() == kept.finish.tolist() and (ablation.outcome == kept.outcome).all()
    # patience without limit is the plain run
    plain = simulate(DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10, max_wait=0.0), trace, TINY_COST,
                     instances=1)
    assert set(OUTCOMES[o] for o in plain.outcome) == {"ok"}
    with pytest.raises(ValueError, match="client_timeout"):
        simulate(DeadlineBatching(TINY_GRID, TINY_COST, max_queue=10), trace, TINY_COST, instances=1,
                 client_timeout=0.0)


def test_two_instances_run_in_parallel_and_full_queue_rejects():
    trace = make_trace([0.0, 0.0, 0.0, 0.0, 0.0, 0.5], model="vit")
    policy = DeadlineBatching(TINY_GRID, TINY_COST, max_queue=3, max_wait=0.0)
    r = simulate(policy, trace, TINY_COST, instances=2)
    # each arrival is planned at once: r0 leaves alone (max_wait 0) on instance 0,
    # r1 alone on instance 1; r2, r3, r4 fill the queue (max_queue 3), so r5 is
    # rejected at 0.5. At 1.0 instance 0 takes the full batch (r2, r3) and
    # instance 1 takes r4 alone.
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "ok", "ok", "ok", "ok", "rejected"]
    assert r.start.tolist()[:5] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert r.batch_instance.tolist() == [0, 1, 0, 1]
    assert r.finish.tolist() == [1.0, 1.0, 2.5, 2.5, 2.0, 0.5]


def test_late_when_the_service_time_exceeds_the_profile():
    trace = make_trace([0.0], model="vit", slo_s=1.5)
    policy = DeadlineBatching(TINY_GRID, TINY_COST, max_wait=0.0)
    r = simulate(policy, trace, TINY_COST, 1, service_time=lambda batch: 2.0)
    assert r.outcome.tolist() == [LATE] and r.finish.tolist() == [2.0]


def test_padding_ratio_is_bucket_over_length():
    grid = {"bert": ShapeGrid((1,), (16, 32))}
    cost = CostModel({"bert": LatencyProfile("bert", {Cell(1, 16): 0.1, Cell(1, 32): 0.2})})
    trace = make_trace([0.0, 1.0, 2.0], model="bert", length=[10, 20, 0], slo_s=1.0)
    r = simulate(DeadlineBatching(grid, cost, max_wait=0.0), trace, cost, 1)
    assert r.cell_seq.tolist() == [16, 32, 16]
    assert r.padding_ratio() == (16 + 32) / (10 + 20)  # length-0 requests excluded
    assert r.finish.tolist() == [0.1, 1.2, 2.1]


def _text_setup():
    grid = ShapeGrid((1, 2, 4, 8, 16), (16, 32, 64))
    cost = CostModel(
        {"bert": LatencyProfile("bert", {c: 0.004 + 1e-5 * c.batch * c.seq for c in grid.cells()})}
    )
    return {"bert": grid}, cost


@pytest.mark.parametrize("load_rate", [100.0, 3000.0, 20000.0])
def test_conservation_every_request_has_exactly_one_outcome(load_rate):
    grids, cost = _text_setup()
    n = 5000
    arrivals = poisson_arrivals(load_rate, n=n, seed=1)
    trace = make_trace(
        arrivals,
        model="bert",
        length=sample_lengths(np.arange(1, 65), n, seed=2),
        slo_s=np.random.default_rng(3).choice([0.005, 0.02, 0.05, INF], n),
    )
    policy = DeadlineBatching(grids, cost, max_queue=200, max_wait=0.002)
    r = simulate(policy, trace, cost, instances=2, latency_noise=0.3, seed=4)
    counts = r.outcome_counts()
    assert sum(counts.values()) == n == len(r)
    assert np.all(np.isin(r.outcome, [OK, LATE, EVICTED, REJECTED]))
    ran = r.batch >= 0
    assert np.array_equal(ran, r.completed())
    assert r.batch_count.sum() == counts["ok"] + counts["late"]
    assert np.array_equal(np.bincount(r.batch[ran], minlength=len(r.batch_count)), r.batch_count)
    assert np.all(r.cell_batch[ran] >= r.batch_count[r.batch[ran]])
    assert np.all(r.finish >= r.arrival)


@pytest.mark.parametrize("load_rate", [3000.0, 20000.0])
def test_conservation_with_impatient_clients(load_rate):
    """Clients leave after 30 ms: a withdrawn request never ran and ended when its client
    left; an answered one came back before; an abandoned one ran and finished after."""
    grids, cost = _text_setup()
    n, timeout = 5000, 0.03
    trace = make_trace(poisson_arrivals(load_rate, n=n, seed=1), model="bert",
                       length=sample_lengths(np.arange(1, 65), n, seed=2),
                       slo_s=np.random.default_rng(3).choice([0.005, 0.05, INF], n))
    policy = DeadlineBatching(grids, cost, max_queue=200, max_wait=0.002)
    r = simulate(policy, trace, cost, instances=2, latency_noise=0.3, seed=4, client_timeout=timeout)
    counts = r.outcome_counts()
    assert sum(counts.values()) == n and counts["withdrawn"] > 0
    ran = r.batch >= 0
    assert np.array_equal(ran, r.computed())
    assert r.batch_count.sum() == counts["ok"] + counts["late"] + counts["abandoned"]
    withdrawn, abandoned = r.outcome == WITHDRAWN, r.outcome == ABANDONED
    assert np.allclose(r.finish[withdrawn], r.arrival[withdrawn] + timeout)
    assert np.all(r.finish[abandoned] > r.arrival[abandoned] + timeout)
    assert np.all(r.finish[r.completed()] <= r.arrival[r.completed()] + timeout)
    # every request still queued when its client left was withdrawn, so the abandoned ones
    # had started by then
    assert np.all(r.start[abandoned] <= r.arrival[abandoned] + timeout)
    assert np.isnan(r.start[withdrawn]).all()
    assert policy.queue_depth() == 0
    assert np.all(r.start[ran] >= r.arrival[ran])
    ok = r.outcome == OK
    assert np.all(r.finish[ok] <= r.deadline[ok])
    assert np.all(r.finish[r.outcome == LATE] > r.deadline[r.outcome == LATE])
    # instances never overlap: each one's batches run back to back at most
    for inst in range(2):
        mine = r.batch_instance == inst
        s, f = r.batch_start[mine], r.batch_finish[mine]
        assert np.all(s[1:] >= f[:-1])
    if load_rate == 20000.0:  # overload: the queue bound and evictions both bite
        assert counts["rejected"] > 0 and counts["evicted"] > 0 and counts["ok"] > 0


def test_low_load_latency_is_service_time_plus_max_wait():
    grid = {"vit": ShapeGrid((1, 2, 4, 8))}
    cost = CostModel({"vit": LatencyProfile("vit", {Cell(1): 0.01, Cell(2): 0.012, Cell(4): 0.015, Cell(8): 0.02})})
    trace = make_trace(poisson_arrivals(1.0, n=2000, seed=0), model="vit", slo_s=1.0)
    r = simulate(DeadlineBatching(grid, cost, max_wait=0.0), trace, cost, instances=2)
    assert r.mean_latency() == pytest.approx(0.01, rel=0.01)
    assert r.mean_batch_size() == pytest.approx(1.0, abs=0.01)
    r = simulate(DeadlineBatching(grid, cost, max_wait=0.004), trace, cost, instances=2)
    assert r.mean_latency() == pytest.approx(0.014, rel=0.01)
    assert r.slo_attainment() == 1.0


def test_batch_overhead_holds_the_instance_and_counts_in_latency():
    grid = {"vit": ShapeGrid((1, 2, 4, 8))}
    cost = CostModel({"vit": LatencyProfile("vit", {Cell(1): 0.01, Cell(2): 0.012, Cell(4): 0.015, Cell(8): 0.02})})
    low = make_trace(poisson_arrivals(1.0, n=2000, seed=0), model="vit", slo_s=1.0)
    r = simulate(DeadlineBatching(grid, cost, max_wait=0.0), low, cost, instances=2, batch_overhead=0.003)
    assert r.mean_latency() == pytest.approx(0.013, rel=0.01)
    assert np.allclose(r.batch_finish - r.batch_start, 0.013)
    # under load the instance is held for the overhead too, so queues grow more than the overhead itself
    busy = make_trace(poisson_arrivals(60.0, n=4000, seed=1), model="vit", slo_s=1.0)
    base = simulate(DeadlineBatching(grid, cost, max_wait=0.0), busy, cost, instances=1)
    held = simulate(DeadlineBatching(grid, cost, max_wait=0.0), busy, cost, instances=1, batch_overhead=0.003)
    assert held.utilization() > base.utilization()
    assert held.mean_latency() - base.mean_latency() > 0.003
    with pytest.raises(ValueError, match="batch_overhead"):
        simulate(DeadlineBatching(grid, cost), low, cost, instances=1, batch_overhead=-1.0)


def test_same_inputs_same_result_and_noise_is_mean_one():
    grids, cost = _text_setup()
    n = 3000
    trace = make_trace(
        poisson_arrivals(500.0, n=n, seed=0), model="bert", length=sample_lengths(40, n, seed=0), slo_s=0.1
    )
    runs = [
        simulate(DeadlineBatching(grids, cost), trace, cost, 4, latency_noise=0.2, seed=9) for _ in range(2)
    ]
    assert np.array_equal(runs[0].finish, runs[1].finish)
    durations = runs[0].batch_finish - runs[0].batch_start
    priced = np.array([0.004 + 1e-5 * b * 64 for b in runs[0].cell_batch[runs[0].batch >= 0]])
    per_request = (runs[0].finish - runs[0].start)[runs[0].batch >= 0]
    assert np.mean(per_request / priced) == pytest.approx(1.0, abs=0.03)
    assert durations.std() > 0


# -- other policies: the contract, not DeadlineBatching ------------------------------------


class FifoOneByOne(Policy):
    """A minimal policy with no opinion on admission: one request per batch, first idle instance."""

    def __init__(self):
        self.queue = []

    def on_arrival(self, request: Request, now: float) -> None:
        self.queue.append(request.id)

    def on_completion(self, batch: Batch, now: float, summaries=None) -> None:
        pass

    def plan(self, now, idle_instances):
        batches = []
        for inst in idle_instances:
            if not self.queue:
                break
            batches.append(Batch((self.queue.pop(0),), "vit", Cell(1), inst))
        return Plan(tuple(batches))

    def queue_depth(self) -> int:
        return len(self.queue)


def test_policy_with_no_opinion_on_admission_uses_max_queue():
    trace = make_trace([0.0] * 5, model="vit")
    r = simulate(FifoOneByOne(), trace, TINY_COST, 1, max_queue=2)
    # r0 starts at once, r1 and r2 queue, r3 and r4 are rejected
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "ok", "ok", "rejected", "rejected"]
    assert r.finish.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]


class OneBatchPerCall(FifoOneByOne):
    """Dispatches one batch per plan and asks to be called again at once."""

    def plan(self, now, idle_instances):
        if self.queue and idle_instances:
            batch = Batch((self.queue.pop(0),), "vit", Cell(1), idle_instances[0])
            return Plan((batch,), wake_at=now)
        return Plan()


def test_immediate_wake_after_progress_is_honoured():
    trace = make_trace([0.0, 0.0, 0.0], model="vit")
    r = simulate(OneBatchPerCall(), trace, TINY_COST, 3)
    assert r.start.tolist() == [0.0, 0.0, 0.0]


class BusyAssigner(FifoOneByOne):
    def plan(self, now, idle_instances):
        if self.queue:
            return Plan((Batch((self.queue.pop(0),), "vit", Cell(1), 0),))
        return Plan()


class Hoarder(FifoOneByOne):
    def plan(self, now, idle_instances):
        return Plan()


class Spinner(FifoOneByOne):
    def plan(self, now, idle_instances):
        return Plan(wake_at=now)


class DoubleBatcher(FifoOneByOne):
    def plan(self, now, idle_instances):
        if self.queue and len(idle_instances) >= 2:
            r = self.queue[0]
            return Plan((Batch((r,), "vit", Cell(1), idle_instances[0]), Batch((r,), "vit", Cell(1), idle_instances[1])))
        return Plan()


# -- the idle instances handed to plan, and the paused collector ----------------------------


def test_idle_instances_keep_increasing_order_and_record_who_joined():
    idle = IdleInstances([5, 1, 3])
    assert list(idle) == [1, 3, 5] and idle.joined == {1, 3, 5} and idle.calls == 0
    idle.planned()
    assert idle.joined == set() and idle.calls == 1
    idle.leave(3)
    idle.join(4)
    idle.join(0)
    assert list(idle) == [0, 1, 4, 5] and idle.joined == {0, 4}
    assert idle.holds(4) and idle.holds(0) and not idle.holds(3) and not idle.holds(9) and not idle.holds(-1)
    with pytest.raises(ValueError, match="worker 3 is not idle"):
        idle.leave(3)


class IdleRecorder(FifoOneByOne):
    """Records at each plan: the idle ids, the ids that joined since the last plan, the call
    count, the instances it gave batches to, and whether the cyclic collector was on."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def plan(self, now, idle_instances):
        plan = super().plan(now, idle_instances)
        self.seen.append((list(idle_instances), set(idle_instances.joined), idle_instances.calls,
                          {b.instance for b in plan.batches}, gc.isenabled()))
        return plan


def test_plan_gets_every_instance_that_became_idle_since_its_last_call():
    """IdleInstances' contract as the simulator keeps it: increasing ids, a call count, and
    ``joined`` holding every id idle now that was not left idle by the previous plan."""
    trace = make_trace(poisson_arrivals(3.0, n=300, seed=0), model="vit")
    policy = IdleRecorder()
    r = simulate(policy, trace, TINY_COST, 4, latency_noise=0.5, seed=1)
    assert (r.outcome == OK).all()
    previous = set(range(4))  # before the first plan every instance joined
    for k, (idle, joined, calls, dispatched, _) in enumerate(policy.seen):
        assert idle == sorted(idle) and calls == k
        assert set(idle) - previous <= joined, k
        previous = set(idle) - dispatched
    assert sum(len(j) for _, j, *_ in policy.seen) >= 300  # instances did come back, many times


def test_the_cyclic_collector_is_paused_during_a_run_and_restored_after():
    trace = make_trace([0.0, 0.5, 1.0], model="vit")
    assert gc.isenabled()
    policy = IdleRecorder()
    simulate(policy, trace, TINY_COST, 2)
    assert not any(on for *_, on in policy.seen) and gc.isenabled()
    with pytest.raises(RuntimeError, match="busy"):  # a broken policy: restored all the same
        simulate(BusyAssigner(), make_trace([0.0, 0.0], model="vit"), TINY_COST, 2)
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(IdleRecorder(), trace, TINY_COST, 2)
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "bad, message",
    [(BusyAssigner, "busy"), (Hoarder, "never answered"), (Spinner, "woken"), (DoubleBatcher, "not queued")],
)
def test_contract_violations_are_caught(bad, message):
    trace = make_trace([0.0, 0.0], model="vit")
    with pytest.raises(RuntimeError, match=message):
        simulate(bad(), trace, TINY_COST, 2)


def test_summary_has_the_headline_numbers():
    grids, cost = _text_setup()
    trace = make_trace(poisson_arrivals(200.0, n=500, seed=0), model="bert", length=20, slo_s=0.05)
    s = simulate(DeadlineBatching(grids, cost), trace, cost, 1).summary()
    assert s["requests"] == 500 and s["ok"] + s["late"] + s["evicted"] + s["rejected"] == 500
    assert s["p50"] <= s["p98"] <= s["p99"] and 0 < s["utilization"] <= 1
    assert s["padding_ratio"] == 32 / 20


def test_two_models_share_the_instances_and_keep_their_own_queues():
    grids, cost = _text_setup()
    grids = {**grids, "vit": TINY_GRID["vit"]}
    cost = cost.merged(CostModel({"vit": LatencyProfile("vit", {Cell(1): 0.01, Cell(2): 0.015})}))
    text = make_trace(poisson_arrivals(50.0, n=300, seed=0), model="bert", length=20, slo_s=0.1)
    image = make_trace(poisson_arrivals(0.5, n=20, seed=1), model="vit", slo_s=5.0)
    trace = merge_traces(text, image)
    r = simulate(DeadlineBatching(grids, cost, max_wait=0.01), trace, cost, instances=2)
    assert r.outcome_counts()["ok"] == 320
    is_vit = trace.model == "vit"
    assert set(r.cell_seq[is_vit].tolist()) == {0} and set(r.cell_seq[~is_vit].tolist()) == {32}
    for b, count in enumerate(r.batch_count):  # no batch mixes models
        members = r.batch == b
        assert len(set(trace.model[members].tolist())) == 1 and members.sum() == count


@pytest.mark.parametrize("seed", [3, 37])
def test_a_policy_that_plans_exactly_is_never_late_on_the_virtual_clock(seed):
    """With service times exactly the cost model's, DeadlineBatching never starts a batch that
    cannot meet its deadlines, so nothing is late. Its latest start is ``deadline - latency``,
    and on a float clock that start plus the latency can land an ulp past the deadline: these
    (non-dyadic) profiles and traces each made a request 'late' by under a microsecond."""
    from jaxserve.traces import gamma_arrivals

    rng = np.random.default_rng(seed)
    batches = tuple(sorted(set(rng.choice([1, 2, 3, 4, 6, 8, 16], size=rng.integers(1, 5), replace=False).tolist())
                           | {1}))
    buckets = tuple(sorted(set(rng.choice([16, 32, 48, 64, 128], size=rng.integers(1, 4), replace=False).tolist())))
    grid = ShapeGrid(batches, buckets)
    a, c, q = rng.uniform(0.001, 0.005), rng.uniform(1e-6, 2e-5), rng.uniform(0.6, 1.0)
    cost = CostModel({"m": LatencyProfile("m", {cl: a + c * cl.batch ** q * cl.seq for cl in grid.cells()})})
    n = 3000
    arrivals = gamma_arrivals(rng.uniform(50, 3000), rng.uniform(0.5, 4), n=n, seed=seed)
    trace = make_trace(arrivals, model="m", length=sample_lengths(np.arange(1, max(buckets) + 1), n, seed=seed + 1),
                       slo_s=rng.choice([0.01, 0.02, 0.05, 0.2, math.inf], n))
    policy = DeadlineBatching({"m": grid}, cost, max_queue=int(rng.integers(5, 500)),
                              max_wait=float(rng.choice([0, 0.002, 0.01])))
    r = simulate(policy, trace, cost, int(rng.integers(1, 4)))
    assert r.outcome_counts()["late"] == 0
    assert r.outcome_counts()["ok"] > 0
