"""Arlo (jaxserve/sched/arlo/): exact allocation, replacement, Alg. 1, autoscaling, policy."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import numpy as np
import pytest

from jaxserve.sched.arlo import (
    AllocationProblem,
    ArloPolicy,
    InterGroupGreedy,
    InterGroupGreedyByLoad,
    IntraGroupBalance,
    LatencyCurve,
    Move,
    MultiLevelDispatcher,
    RuntimeScheduler,
    TargetTrackingAutoscaler,
    allocation_objective,
    allocation_problem,
    demand_per_window,
    replacement_plan,
    solve_allocation,
    solve_allocation_dp,
    solve_allocation_milp,
)
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, Request, ShapeGrid
from jaxserve.sched.baselines import FirstFitDispatcher
from jaxserve.simulator import WITHDRAWN, simulate
from jaxserve.traces import make_trace, poisson_arrivals


def linear(per_request: float):
    """L(b) = l * b: batch-1 runtime, time to drain b requests (LatencyProfile's extrapolation)."""
    return lambda b: per_request * b


def problem(q, m, g, lat):
    return AllocationProblem(tuple(q), tuple(m), g, tuple(linear(x) for x in lat))


def brute_force(p: AllocationProblem) -> float:
    lb, _ = p.lower_bounds()
    best = math.inf
    for head in itertools.product(*(range(lb[i], p.instances + 1) for i in range(p.runtimes - 1))):
        rest = p.instances - sum(head)
        if rest >= lb[-1]:
            best = min(best, allocation_objective(p, head + (rest,)))
    return best


def random_curve(rng: random.Random, base: float):
    if rng.random() < 0.5:
        return linear(base)
    steps = [base]
    for _ in range(40):  # nondecreasing, often concave: g(b) = b L(b) nonconvex
        steps.append(steps[-1] + rng.random() * base * (0.05 if rng.random() < 0.5 else 1.0))
    return lambda b, s=steps: s[b - 1] if b <= len(s) else s[-1] + base * (b - len(s))


# -- Runtime Scheduler: the allocation problem -----------------------------------------


def test_dp_and_milp_match_brute_force_on_random_small_instances():
    rng = random.Random(1)
    for _ in range(120):
        n = rng.randint(1, 4)
        p = AllocationProblem(
            tuple(rng.randint(0, 14) for _ in range(n)),
            tuple(rng.randint(1, 6) for _ in range(n)),
            rng.randint(1, 7),
            tuple(random_curve(rng, 0.01 * (i + 1)) for i in range(n)),
        )
        best = brute_force(p)
        dp, milp = solve_allocation_dp(p), solve_allocation_milp(p)
        assert dp.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert milp.objective == pytest.approx(best, rel=1e-7, abs=1e-9)
        for a in (dp, milp):
            assert sum(a.counts) == p.instances and a.counts[-1] >= 1
            assert all(c >= b for c, b in zip(a.counts, p.lower_bounds()[0]))


def test_dp_and_milp_agree_on_random_larger_instances():
    rng = random.Random(2)
    for _ in range(8):
        n = rng.randint(3, 8)
        g = rng.randint(10, 60)
        m = tuple(rng.randint(2, 30) for _ in range(n))
        load = rng.uniform(0.2, 1.3)
        q = tuple(int(rng.expovariate(1.0) * load * g * m[i] / n) for i in range(n))
        p = AllocationProblem(q, m, g, tuple(random_curve(rng, 0.002 * (i + 1)) for i in range(n)))
        dp, milp = solve_allocation_dp(p), solve_allocation_milp(p)
        assert dp.objective == pytest.approx(milp.objective, rel=1e-7)
        assert allocation_objective(p, dp.counts) == pytest.approx(dp.objective)


def test_milp_out_of_time_still_answers_with_a_valid_allocation():
    """HiGHS stopped by its time limit: the allocation it holds (or the DP's) comes back, marked
    as such, instead of an exception escaping into the request that made the solve due."""
    rng = random.Random(7)
    n, g = 10, 600
    m = tuple(rng.randint(2, 30) for _ in range(n))
    q = tuple(int(rng.expovariate(1.0) * g * m[i] / n) for i in range(n))
    p = AllocationProblem(q, m, g, tuple(random_curve(rng, 0.002 * (i + 1)) for i in range(n)))
    hurried = solve_allocation(p, "milp", time_limit=0.01)
    assert "time limit" in hurried.solver
    lb, _ = p.lower_bounds()
    assert sum(hurried.counts) == g and all(c >= b for c, b in zip(hurried.counts, lb))
    assert hurried.objective == pytest.approx(allocation_objective(p, hurried.counts))
    assert hurried.objective >= solve_allocation_dp(p).objective * (1 - 1e-9)


def test_hand_computed_allocation_prefers_spreading_the_longer_runtime():
    # Q=(2,2), M=(2,2), L=(b, 2b), G=3.  (2,1): 2 g1(1) + g2(2) = 2*1 + 2*4 = 10.
    # (1,2): g1(2) + 2 g2(1) = 4 + 2*2 = 8  -> optimum.
    p = problem([2, 2], [2, 2], 3, [1.0, 2.0])
    assert allocation_objective(p, (2, 1)) == pytest.approx(10.0)
    assert allocation_objective(p, (1, 2)) == pytest.approx(8.0)
    for solve in (solve_allocation_dp, solve_allocation_milp):
        a = solve(p)
        assert a.counts == (1, 2) and a.objective == pytest.approx(8.0) and a.feasible


def test_hand_computed_overflow_and_uneven_split():
    # Q=(5,0), M=(2,5), L=(b, 3b), G=4, lower bounds (2,1).
    # (3,1): 5 requests on 3 instances = 1+2+2 -> g1(1) + 2 g1(2) = 1 + 8 = 9; nothing overflows.
    # (2,1)+1 on runtime 2 = (2,2): C1 = 4 (cost 2 g1(2) = 8), R1 = 1, C2 = 1 on 2 instances -> 3.
    p = problem([5, 0], [2, 5], 4, [1.0, 3.0])
    assert allocation_objective(p, (2, 2)) == pytest.approx(11.0)
    for solve in (solve_allocation_dp, solve_allocation_milp):
        a = solve(p)
        assert a.counts == (3, 1) and a.objective == pytest.approx(9.0)
        assert a.served == (5, 0) and a.overflow == (0, 0)


def test_a_runtime_may_get_zero_instances_and_overflow_passes_it():
    # Nothing of bin 1: N_1 = 0 is optimal (the last runtime spreads better with 3).
    p = problem([0, 10], [5, 5], 3, [1.0, 1.0])
    for solve in (solve_allocation_dp, solve_allocation_milp):
        assert solve(p).counts == (0, 3)
    # An undeployed middle runtime passes all its overflow on (Eq. 4-5 literally).
    p = problem([7, 0, 0], [3, 3, 3], 3, [1.0, 2.0, 3.0])
    a = solve_allocation_dp(p)
    assert a.counts == (2, 0, 1)
    assert a.served == (6, 0, 1) and a.overflow == (1, 1, 0)
    assert a.objective == pytest.approx(2 * 3 * 3 * 1.0 + 1 * 3.0)


def test_the_longest_runtime_always_gets_an_instance():
    p = problem([9, 0], [3, 3], 4, [1.0, 5.0])  # lower bounds (3, 0) -> (3, 1) by Eq. 7
    assert p.minimum_instances() == (3, 1)
    for solve in (solve_allocation_dp, solve_allocation_milp):
        assert solve(p).counts == (3, 1)


def test_infeasible_lower_bounds_are_scaled_down_proportionally():
    p = problem([10, 10], [1, 1], 4, [1.0, 1.0])  # needs 20 instances, has 4
    assert p.lower_bounds() == ((2, 2), False)
    for solve in (solve_allocation_dp, solve_allocation_milp):
        a = solve(p)
        assert a.counts == (2, 2) and not a.feasible
    # scaling leaves the last runtime at 0: Eq. 7 takes one from the largest other bound
    p = problem([10, 0], [1, 1], 3, [1.0, 1.0])
    assert p.lower_bounds() == ((2, 1), False)
    assert solve_allocation_dp(p).counts == solve_allocation_milp(p).counts == (2, 1)


def test_latency_must_be_nondecreasing():
    p = AllocationProblem((4,), (4,), 1, (lambda b: 1.0 / b,))
    with pytest.raises(ValueError):
        solve_allocation_dp(p)
    with pytest.raises(ValueError):
        AllocationProblem((1,), (0,), 1, (linear(1.0),))
    with pytest.raises(ValueError):
        AllocationProblem((1,), (1,), 0, (linear(1.0),))


def test_latency_curve_follows_the_profile_and_gives_capacity():
    prof = LatencyProfile("m", {Cell(1, 64): 0.010, Cell(2, 64): 0.009, Cell(4, 64): 0.020})
    curve = LatencyCurve(prof, 64, max_batch=4)
    assert curve(1) == 0.010
    assert curve(2) == 0.010  # made nondecreasing (running max)
    assert curve(3) == pytest.approx(prof.latency_for(3, 64))
    assert curve(8) == pytest.approx(prof.latency_for(8, 64))  # drain in full batches
    assert curve.capacity(0.100) == 20  # 0.020 * 20 / 4 = 0.100
    assert LatencyCurve(prof, 64, max_batch=1)(3) == pytest.approx(0.030)
    # no batch-1 cell: one request per run, padded into the batch-2 executable
    no_ones = LatencyProfile("m", {Cell(2, 64): 0.012, Cell(4, 64): 0.020})
    assert LatencyCurve(no_ones, 64, max_batch=1)(3) == pytest.approx(0.036)
    assert LatencyCurve(no_ones, 64, max_batch=1).capacity(0.1) == 8
    # an SLO that is an exact multiple of the latency is met by exactly that many requests
    for ms in range(1, 31):
        for k in range(1, 60):
            assert RuntimeScheduler((64,), (linear(ms / 1000),), slo=ms * k / 1000).capacity == (k,), (ms, k)
    p = allocation_problem([30, 5], [64, 128], LatencyProfile("m", {Cell(1, 64): 0.01, Cell(1, 128): 0.02}), 3, 0.1)
    assert p.capacity == (10, 5)


# -- replacement plan -------------------------------------------------------------------


def apply_plan(current, moves):
    after = dict(current)
    for mv in moves:
        if mv.target is None:
            del after[mv.instance]
        else:
            after[mv.instance] = mv.target
    return after


def test_identical_allocation_needs_no_replacement():
    current = {0: 0, 1: 0, 2: 1, 3: 2}
    assert replacement_plan(current, (2, 1, 1)) == ()


def test_replacement_plan_is_minimal_by_brute_force():
    rng = random.Random(3)
    for _ in range(200):
        n_rt, n_inst = rng.randint(1, 3), rng.randint(1, 5)
        current = {i: rng.randrange(n_rt) for i in range(n_inst)}
        target = [0] * n_rt
        for _ in range(n_inst):
            target[rng.randrange(n_rt)] += 1
        moves = replacement_plan(current, target)
        after = apply_plan(current, moves)
        assert [list(after.values()).count(r) for r in range(n_rt)] == target
        changed = sum(1 for i in current if after[i] != current[i])
        best = min(
            sum(1 for i, r in zip(current, assign) if r != current[i])
            for assign in itertools.product(range(n_rt), repeat=n_inst)
            if [assign.count(r) for r in range(n_rt)] == target
        )
        assert changed == best == len(moves)


def test_replacement_moves_the_least_loaded_and_handles_size_changes():
    current = {0: 0, 1: 0, 2: 0, 3: 1}
    moves = replacement_plan(current, (1, 3), load={0: 5, 1: 0, 2: 2})
    assert moves == (Move(1, 0, 1), Move(2, 0, 1))
    grow = replacement_plan({0: 0}, (1, 2))
    assert grow == (Move(1, None, 1), Move(2, None, 1))
    shrink = replacement_plan({0: 0, 1: 1, 2: 1}, (1, 1))
    assert shrink == (Move(2, 1, None),)


# -- Runtime Scheduler driver ------------------------------------------------------------


def test_runtime_scheduler_reallocates_once_per_period():
    rs = RuntimeScheduler((64, 128), (linear(0.01), linear(0.02)), slo=0.1, period=120.0)
    assert rs.capacity == (10, 5)
    assignment = {0: 0, 1: 1, 2: 1, 3: 1}
    for k in range(1200):  # 10 req/s of length 10 over 0..120 s: Q_1 = 1 per 0.1 s SLO period
        rs.observe(10, k * 0.1)
    assert rs.maybe_reallocate(0.0, assignment) is None  # starts the clock
    assert rs.maybe_reallocate(119.9, assignment) is None
    realloc = rs.maybe_reallocate(120.0, assignment)
    assert realloc is not None and realloc.demand == (1, 0)
    assert sum(realloc.allocation.counts) == 4
    assert rs.maybe_reallocate(200.0, assignment) is None
    assert rs.maybe_reallocate(240.0, assignment) is None  # period over, but the window is empty
    rs.observe(10, 250.0)
    assert rs.maybe_reallocate(359.0, assignment) is None  # the empty solve at 240 restarted the clock
    assert rs.maybe_reallocate(360.0, assignment) is not None


def test_runtime_scheduler_moves_instances_to_the_busy_runtime_and_keeps_ties():
    rs = RuntimeScheduler((64, 128), (linear(0.01), linear(0.02)), slo=0.1, period=10.0)
    assignment = {i: 1 for i in range(6)}
    rs.maybe_reallocate(0.0, assignment)
    for k in range(1000):  # 100 req/s of short requests over 10 s -> Q_1 = 10 per SLO period
        rs.observe(20, k * 0.01)
    realloc = rs.maybe_reallocate(10.0, assignment)
    assert realloc.demand == (10, 0)
    assert realloc.allocation.counts == solve_allocation_dp(rs.problem((10, 0), 6)).counts
    assert realloc.allocation.counts[0] >= 1
    moved = apply_plan(assignment, realloc.moves)
    # same demand again: the allocation is already optimal, nothing moves
    for k in range(1000):
        rs.observe(20, 10.0 + k * 0.01)
    again = rs.maybe_reallocate(20.0, moved)
    assert again.moves == ()


def test_runtime_scheduler_keeps_the_current_allocation_within_hysteresis():
    """A feasible current allocation within ``hysteresis`` of the optimum is kept (no moves);
    with none it is replaced by the optimum."""
    assignment = {i: 1 for i in range(6)}
    plans = {}
    for hysteresis in (0.0, 10.0):
        rs = RuntimeScheduler((64, 128), (linear(0.01), linear(0.02)), slo=0.1, period=10.0, hysteresis=hysteresis)
        rs.maybe_reallocate(0.0, assignment)
        for k in range(500):  # Q_1 = 5 < M_1: all six on the long runtime is feasible, not optimal
            rs.observe(20, k * 0.02)
        plans[hysteresis] = rs.maybe_reallocate(10.0, assignment)
    optimum, kept = plans[0.0], plans[10.0]
    assert optimum.allocation.counts != (0, 6) and optimum.moves
    assert kept.allocation.counts == (0, 6) and kept.allocation.solver == "dp+kept" and kept.moves == ()
    assert kept.allocation.objective > optimum.allocation.objective


def test_demand_rounding_preserves_the_rounded_total():
    assert demand_per_window([9, 9, 9], 9.0, 1.0) == (1, 1, 1)
    assert demand_per_window([3, 3, 3], 9.0, 1.0) == (1, 0, 0)  # total 1; ties by runtime order
    assert demand_per_window([5, 6, 0], 4.0, 1.0) == (1, 2, 0)  # 1.25, 1.5 -> total round(2.75) = 3
    assert demand_per_window([1, 0], 2.0, 1.0) == (1, 0)  # 0.5 rounds half up
    assert sum(demand_per_window([7, 1, 1, 1], 3.0, 1.0)) == round(10 / 3)


# -- Request Scheduler (Alg. 1) ----------------------------------------------------------


def dispatcher(loads_by_level, capacity, cls=MultiLevelDispatcher, **kw):
    """Instances numbered in order; ``loads_by_level[j]`` lists their outstanding loads."""
    buckets = tuple(128 * (j + 1) for j in range(len(capacity)))
    d = cls(buckets, capacity, **kw)
    inst = 0
    for level, loads in enumerate(loads_by_level):
        for load in loads:
            d.add_instance(inst, level, load)
            inst += 1
    return d


def test_alg1_paper_example_demotes_to_the_third_level():
    # Fig. 5: length 200 -> candidates Q2, Q3, Q4; Q2 head 54/60 >= 0.85, Q3 head 28/48 < 0.765.
    d = dispatcher([[0], [54, 58], [28, 40], [0]], [60, 60, 48, 60], peek=3)
    assert d.dispatch(200) == 3  # instance 3 = head of level 2 (Q3)
    assert d.load(3) == 29


def test_alg1_uses_own_level_when_below_threshold():
    d = dispatcher([[50, 10], [0]], [60, 60])
    assert d.dispatch(100) == 1  # head of own level: load 10/60 < 0.85
    assert d.load(1) == 11


def test_alg1_threshold_is_strict_and_decays():
    # own level P = 51/60 = 0.85 exactly: not < lambda -> next level, which needs P < 0.765:
    # 46/60 = 0.7667 fails, so the level after (threshold 0.6885) with 41/60 = 0.683 wins.
    d = dispatcher([[51], [46], [41]], [60, 60, 60])
    assert d.dispatch(10) == 2
    d = dispatcher([[51], [45], [0]], [60, 60, 60])  # 45/60 = 0.75 < 0.765
    assert d.dispatch(10) == 1


def test_alg1_respects_the_peek_limit_and_falls_back_to_the_first_candidate():
    loads = [[59], [59], [59], [0]]
    assert dispatcher(loads, [60] * 4, peek=3).dispatch(1) == 0  # level 4 is never peeked
    assert dispatcher(loads, [60] * 4, peek=4).dispatch(1) == 3
    # candidates start at the request's own level: a 300-token request never sees levels 1-2
    assert dispatcher([[0], [0], [59], [59]], [60] * 4, peek=6).dispatch(300) == 2


def test_alg1_skips_empty_levels_and_handles_no_candidate():
    d = dispatcher([[59], [], [10]], [60, 60, 60], peek=2)
    assert d.dispatch(1) == 1  # empty level 2 is not a candidate; level 3 is the 2nd
    d = MultiLevelDispatcher((128, 256), (10, 10))
    d.add_instance(7, 0)
    assert d.dispatch(200) is None
    with pytest.raises(ValueError):
        d.dispatch(257)


def test_alg1_load_updates_reorder_the_heap():
    d = dispatcher([[3, 5]], [60])
    assert d.dispatch(1) == 0 and d.load(0) == 4
    d.complete(1, 5)  # instance 1 drains: now the least loaded
    assert d.load(1) == 0
    assert d.dispatch(1) == 1
    d.complete(0, 4)
    assert [d.dispatch(1) for _ in range(3)] == [0, 0, 1]  # (0:0,1:1) -> 0, (1,1) tie -> id 0, then 1
    d.move_instance(1, 0, load=0)
    d.remove_instance(0)
    assert d.dispatch(1) == 1 and d.instances() == (1,)
    with pytest.raises(ValueError):
        d.complete(1, 5)


def test_dispatch_many_equals_sequential_dispatch():
    rng = random.Random(4)
    caps = [30, 25, 20, 15, 10, 8]
    loads = [[rng.randrange(c + 5) for _ in range(7)] for c in caps]
    lengths = [rng.randint(1, 768) for _ in range(500)]
    for cls in (MultiLevelDispatcher, IntraGroupBalance, InterGroupGreedy, InterGroupGreedyByLoad):
        a, b = dispatcher(loads, caps, cls=cls), dispatcher(loads, caps, cls=cls)
        assert a.dispatch_many(lengths) == [b.dispatch(n) for n in lengths], cls  # its own rule, not Alg. 1's
        assert a.loads() == b.loads()


def test_ilb_stays_in_the_own_runtime_and_ig_takes_the_least_congested():
    loads, caps = [[59, 58], [0], [1]], [60, 60, 10]
    ilb = dispatcher(loads, caps, cls=IntraGroupBalance)
    assert ilb.dispatch(1) == 1  # least loaded of its own runtime, however congested
    ig = dispatcher(loads, caps, cls=InterGroupGreedy)
    assert ig.dispatch(1) == 2  # 0/60 beats 1/10 and 58/60
    assert ig.dispatch(200) == 2  # level 2 (1/60) vs level 3 (1/10)
    assert ig.dispatch(300) == 3


# -- autoscaling -------------------------------------------------------------------------


def test_autoscaler_scales_out_at_95_percent_of_slo_with_cooldown():
    a = TargetTrackingAutoscaler(slo=1.0, window=10.0, interval=1.0, cooldown=10.0, longest_runtime=3)
    for k in range(100):
        a.observe(0.5, 0.0)
    a.observe(0.96, 0.0)
    a.observe(0.97, 0.0)
    d = a.decide(0.0, 4)  # p98 of 102 values: rank 100 -> 0.5
    assert d is None
    a.observe(0.96, 0.5)
    a.observe(0.96, 0.5)
    assert a.decide(0.5, 4) is None  # within the evaluation interval
    d = a.decide(1.0, 4)
    assert d is not None and d.action == "out" and d.runtime == 3 and d.p98 == 0.96
    assert a.decide(5.0, 5) is None  # cooldown
    a.observe(2.0, 10.5)
    assert a.decide(10.5, 5) is None  # 9.5 s after the scale-out: still cooling down
    assert a.decide(11.0, 5) is None  # evaluated at most once per interval
    assert a.decide(11.5, 5).action == "out"  # cooldown over, still slow


def test_autoscaler_scales_in_after_60_s_below_half_slo():
    a = TargetTrackingAutoscaler(slo=1.0, window=10.0, interval=1.0, min_instances=2)
    t = 0.0
    while t < 60.0:
        a.observe(0.3, t)
        assert a.decide(t, 3) is None
        t += 1.0
    a.observe(0.3, 60.0)
    d = a.decide(60.0, 3)
    assert d is not None and d.action == "in"
    assert a.decide(61.0, 2) is None  # the 60 s restart
    # one evaluation at >= 50% SLO resets the clock
    b = TargetTrackingAutoscaler(slo=1.0, window=1.0, interval=1.0)
    for t in range(0, 59):
        b.observe(0.1, float(t))
        b.decide(float(t), 3)
    b.observe(0.6, 59.0)
    assert b.decide(59.0, 3) is None
    for t in range(60, 120):
        b.observe(0.1, float(t))
        assert b.decide(float(t), 3) is None
    b.observe(0.1, 120.0)
    assert b.decide(120.0, 3).action == "in"  # below at every evaluation since 60.0
    assert b.decide(180.0, 1) is None  # min_instances


# -- the policy ----------------------------------------------------------------------------


def make_policy(instances=6, **kw):
    buckets = (64, 128, 256)
    prof = LatencyProfile(
        "bert",
        {Cell(b, s): 0.002 * (1 + s / 64) * (1 + 0.5 * (b - 1)) for s in buckets for b in (1, 2, 4)},
    )
    grid = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=buckets)
    kw.setdefault("shared_runtimes", False)  # these tests pin the paper's deployment: one runtime per instance
    kw.setdefault("max_batch", 1)
    return ArloPolicy("bert", grid, prof, slo=0.1, instances=instances, **kw), prof


def test_policy_never_loses_a_request_through_reallocations_and_demotions():
    policy, prof = make_policy(instances=6, period=1.0, replacement_seconds=0.01)
    rng = random.Random(5)
    requests, t = [], 0.0
    for k in range(3000):
        t += rng.expovariate(400.0)
        length = rng.randint(1, 60) if t < 3.0 else rng.randint(100, 256)  # shift to long
        requests.append(Request(k, t, "bert", length=length))

    served: list[int] = []
    busy: dict[int, float] = {}
    events: list = []
    seq = itertools.count()
    for r in requests:
        heapq.heappush(events, (r.arrival, next(seq), "arrive", r))
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrive":
            policy.on_arrival(item, now)
        elif kind == "done":
            del busy[item.instance]
            served.extend(item.request_ids)
            policy.on_completion(item, now)
        idle = [i for i in policy.dispatcher.instances() if i not in busy]
        plan = policy.plan(now, idle)
        for b in plan.batches:
            assert b.instance in idle
            assert b.cell == Cell(1, policy.buckets[policy.dispatcher.level_of(b.instance)])
            busy[b.instance] = now + prof.latency(b.cell)
            heapq.heappush(events, (busy[b.instance], next(seq), "done", b))
        if plan.wake_at < math.inf:
            heapq.heappush(events, (plan.wake_at, next(seq), "wake", None))
    assert sorted(served) == list(range(3000))  # every request exactly once
    assert policy.queue_depth() == 0
    c = policy.counters
    assert c.served == c.dispatched == 3000
    assert c.reallocations >= 3 and c.allocation_changes >= 1 and c.instances_moved >= 1
    assert c.demotions > 0
    assert sum(policy.instances_per_runtime().values()) == 6
    assert all(load == 0 for load in policy.dispatcher.loads().values())


def test_policy_batches_up_to_max_batch_and_counts_demotions():
    policy, _ = make_policy(instances=3, max_batch=4, initial_allocation=(0, 0, 3))
    for k in range(6):
        policy.on_arrival(Request(k, 0.0, "bert", length=10), 0.0)
    assert policy.queue_depth() == 6
    plan = policy.plan(0.0, [0, 1, 2])
    sizes = sorted(len(b.request_ids) for b in plan.batches)
    assert sum(sizes) == 6 and all(b.cell.seq == 256 for b in plan.batches)
    assert all(b.cell.batch >= len(b.request_ids) and b.cell.batch in (1, 2, 4) for b in plan.batches)
    assert policy.counters.demotions == 6  # length 10 belongs to the 64 bucket
    assert policy.instances_per_runtime() == {64: 0, 128: 0, 256: 3}
    with pytest.raises(ValueError):
        policy.on_arrival(Request(99, 0.0, "bert", length=300), 0.0)


def test_policy_scale_in_and_out_keep_every_request():
    scaler = TargetTrackingAutoscaler(slo=0.1, interval=0.0, scale_in_period=0.0)
    policy, _ = make_policy(instances=2, initial_allocation=(1, 0, 1), autoscaler=scaler)
    for k in range(4):
        policy.on_arrival(Request(k, 0.0, "bert", length=10), 0.0)
    plan = policy.plan(0.0, [0])
    (batch,) = plan.batches
    policy.on_completion(batch, 0.001)  # fast -> scale in is proposed
    decision = policy.counters.scale_decisions[-1]
    # instance 1 is idle, but it is the longest runtime's only instance (Eq. 7): 0 goes instead
    assert policy.dispatcher.load(1) < policy.dispatcher.load(0)
    assert decision.action == "in" and decision.instance == 0
    policy.remove_instance(0, 0.001)  # its queued requests move to instance 1
    policy.add_instance(5, 0.001)  # a scale-out worker runs the longest runtime
    assert policy.dispatcher.level_of(5) == 2
    assert policy.queue_depth() == 3
    left = []
    for _ in range(10):
        for b in policy.plan(1.0, [1, 5]).batches:
            left.extend(b.request_ids)
            policy.on_completion(b, 1.0)
    assert sorted(left + list(batch.request_ids)) == [0, 1, 2, 3]


def test_runtime_scheduler_first_solve_after_warmup():
    rs = RuntimeScheduler((64, 128), (linear(0.01), linear(0.02)), slo=0.1, period=120.0, warmup=10.0)
    assignment = {0: 1, 1: 1}
    assert rs.maybe_reallocate(0.0, assignment) is None
    rs.observe(10, 1.0)
    assert rs.maybe_reallocate(9.9, assignment) is None
    assert rs.maybe_reallocate(10.0, assignment) is not None
    rs.observe(10, 11.0)
    assert rs.maybe_reallocate(129.9, assignment) is None
    assert rs.maybe_reallocate(130.0, assignment) is not None
    # headroom plans against a fraction of the SLO
    assert RuntimeScheduler((64, 128), (linear(0.01), linear(0.02)), slo=0.1, headroom=0.5).capacity == (5, 2)


def test_policy_refuses_setups_that_could_never_dispatch():
    with pytest.raises(ValueError, match="at least one instance"):
        make_policy(instances=0)
    with pytest.raises(ValueError, match="longest bucket"):
        make_policy(instances=2, initial_allocation=(1, 1, 0))
    with pytest.raises(ValueError, match=">= 0"):
        make_policy(instances=2, initial_allocation=(3, -2, 1))


def test_a_switching_instance_is_busy_not_empty_to_the_dispatcher():
    """replacement_seconds > 0: instances that switch runtime start no batch until the switch is
    done, so Alg. 1 must not hand them the re-dispatched queue while an instance that stayed is
    idle. They carry the work they could have done meanwhile as load, released when ready."""
    policy, prof = make_policy(instances=3, initial_allocation=(0, 0, 3), period=1.0, warmup=1.0,
                               replacement_seconds=1.0)
    policy.plan(0.0, [0, 1, 2])  # starts the runtime scheduler's clock
    for k in range(39):
        policy.on_arrival(Request(k, k / 40, "bert", length=10), k / 40)
    assert policy.plan(0.99, []).batches == ()  # every instance busy: all 39 stay queued
    policy.on_arrival(Request(39, 1.0, "bert", length=10), 1.0)  # the solve is due: instances switch
    moved = [i for i, rt in policy.assignment().items() if rt != 2]
    stayed = [i for i, rt in policy.assignment().items() if rt == 2]
    assert moved and stayed and policy.counters.instances_moved == len(moved)
    plan = policy.plan(1.0, [0, 1, 2])
    assert [b.instance for b in plan.batches] == stayed  # the ready instance works now
    assert plan.wake_at == pytest.approx(2.0)  # the switching ones start when their switch is done
    served = {r for b in plan.batches for r in b.request_ids}
    for b in plan.batches:
        policy.on_completion(b, 1.0 + prof.latency(b.cell))
    t = 2.0
    while policy.queue_depth():
        for b in policy.plan(t, [0, 1, 2]).batches:
            served |= set(b.request_ids)
            policy.on_completion(b, t)
        t += 0.01
    assert served == set(range(40))
    policy.plan(t + 2.0, [])  # any later switch is done too (no arrivals since: no more solves)
    assert all(load == 0 for load in policy.dispatcher.loads().values())  # the charges were released



def test_in_runtime_groups_a_switching_instance_starts_nothing_until_its_switch_is_done():
    """Runtime groups, replacement_seconds = 1: the solve at t = 1 merges the two groups, so
    instances 0 and 1 switch runtime until t = 2. They take no batch before then, each plan asks
    to be woken when they are ready, and then they take work."""
    policy, _ = make_policy(instances=4, shared_runtimes=True, initial_allocation=(2, 0, 2), period=1.0,
                            warmup=1.0, replacement_seconds=1.0, max_batch=4)
    idle = [0, 1, 2, 3]

    def plan(now):
        got = policy.plan(now, list(idle))
        for b in got.batches:
            idle.remove(b.instance)
            policy.on_completion(b, now + 0.4)  # told early; the instance stays busy until idle again
        return got

    assert plan(0.0).batches == ()
    for k in range(80):  # queued while no plan is asked for
        policy.on_arrival(Request(k, k / 80, "bert", length=200 if k % 2 else 10), k / 80)
    policy.on_arrival(Request(80, 1.0, "bert", length=200), 1.0)  # the solve is due: groups merge
    assert [i for i in range(4) if policy._ready_at[i] > 1.0] == [0, 1] and policy.counters.instances_moved == 2
    served = []
    for now in (1.0, 1.5):
        got = plan(now)
        assert sorted(b.instance for b in got.batches) == [2, 3] and got.wake_at == pytest.approx(2.0)
        served += [r for b in got.batches for r in b.request_ids]
        idle.extend([2, 3])
    got = plan(2.0)
    assert sorted(b.instance for b in got.batches) == [0, 1, 2, 3]  # switched: all four take work
    served += [r for b in got.batches for r in b.request_ids]
    assert len(set(served)) == len(served) == 32  # 2 + 2 + 4 full batches of 4, nothing twice


class EveryIdleArlo(ArloPolicy):
    """The same policy made to look at every idle instance at every plan: a plain tuple of
    idle ids carries no record of which joined since the last plan."""

    def plan(self, now, idle_instances):
        return super().plan(now, tuple(idle_instances))


def _scaling(**kw):
    return dict(instances=4, scale_pool=12, period=1.0, warmup=0.5,
                autoscaler=TargetTrackingAutoscaler(slo=0.1, window=0.5, interval=0.05, scale_in_period=0.3,
                                                    scale_in_below=0.9, cooldown=0.1), **kw)


@pytest.mark.parametrize("kw", [
    lambda: dict(dispatcher="arlo", max_batch=4),
    lambda: dict(dispatcher="ilb"),
    lambda: dict(dispatcher="ig", max_batch=2),
    lambda: dict(dispatcher=FirstFitDispatcher, max_batch=4),
    lambda: dict(dispatcher="arlo", redispatch_queued=True),
    lambda: _scaling(max_batch=2),
    lambda: dict(dispatcher="arlo", shared_runtimes=True, instances=3, rate=600.0),
    lambda: dict(dispatcher="ilb", shared_runtimes=True, instances=3, rate=600.0),
    lambda: _scaling(shared_runtimes=True),
], ids=["alg1", "ilb", "ig", "first-fit", "redispatch", "scaling", "groups", "groups-ilb", "groups-scaling"])
def test_planning_only_changed_instances_runs_as_a_look_at_every_idle_one(kw):
    """Through the simulator (an IdleInstances) the policy looks only at instances that became
    idle, were given a request or were still switching since its last plan (with runtime groups:
    keeps each group's idle instances from plan to plan). The same trace with
    every plan looking at every idle instance must run identically: through reallocations that
    switch instances (``replacement_seconds``), a shift of the lengths, clients who leave, and
    scale-out and scale-in inside a pool of slots."""
    _, prof = make_policy()
    rng = np.random.default_rng(7)
    n = 3200
    rate = kw().get("rate", 800.0)
    burst = poisson_arrivals(rate, n=n // 2, seed=8)
    arrivals = np.concatenate([burst, burst[-1] + poisson_arrivals(rate / 6, n=n - n // 2, seed=9)])  # then a lull
    lengths = np.where(arrivals < arrivals[n // 4], rng.integers(1, 64, n), rng.integers(100, 257, n))  # short, then long
    trace = make_trace(arrivals, model="bert", length=lengths, slo_s=0.1)
    grid = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=(64, 128, 256))
    runs = []
    for cls in (ArloPolicy, EveryIdleArlo):
        args = dict(slo=0.1, instances=12, period=1.0, warmup=0.5, replacement_seconds=0.05, shared_runtimes=False)
        args.update(kw())
        args.pop("rate", None)
        policy = cls("bert", grid, prof, **args)
        slots = args.get("scale_pool") or args["instances"]
        result = simulate(policy, trace, CostModel({"bert": prof}), slots, client_timeout=0.08, latency_noise=0.2,
                          seed=3)
        runs.append((result, policy.counters))
    (fast, fast_counters), (full, full_counters) = runs
    for field in ("start", "finish", "outcome", "batch", "cell_batch", "cell_seq", "batch_start", "batch_finish",
                  "batch_instance"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(full, field), err_msg=field)
    assert fast_counters == full_counters
    assert fast_counters.served > n // 2 and (fast.outcome == WITHDRAWN).any()  # most ran; clients left
    if "autoscaler" in args:
        assert {d.action for d in fast_counters.scale_decisions} == {"out", "in"}  # it scaled both ways
        assert len(policy.instance_log) > 2
    else:
        assert fast_counters.instances_moved > 0  # instances switched runtime (group)
