"""OTAS scheduling (jaxserve/sched/otas.py): Alg. 1 batching, Alg. 2 DP, Alg. 3, baselines.

Pure Python, fake clocks, hand-made profiles: every test runs in milliseconds.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from jaxserve.sched.base import AccuracyProfile, Cell, LatencyProfile, Request, ShapeGrid
from jaxserve.sched.otas import (
    BatchingParams,
    FixedToMePolicy,
    FixedVPTPolicy,
    GammaOption,
    INFaaSPolicy,
    LoadToGamma,
    ModelVariant,
    OTASParams,
    OTASPolicy,
    OutcomeType,
    PetSPolicy,
    manual_allocate,
    solve_token_dp,
)

GAMMAS = (-10, -5, 0, 2, 8)
SCALE = {-10: 0.5, -5: 0.75, 0: 1.0, 2: 1.25, 8: 2.0}
GRID = ShapeGrid(batch_sizes=(1, 4, 8), gammas=GAMMAS)
ACC = {
    "c10": {-10: 0.80, -5: 0.90, 0: 0.93, 2: 0.97, 8: 0.98},
    "c100": {-10: 0.50, -5: 0.70, 0: 0.80, 2: 0.88, 8: 0.90},
}


def latency_profile(name="vit", scale=SCALE, grid=GRID) -> LatencyProfile:
    # latency(b, gamma) = scale(gamma) * (0.01 + 0.005 b): b=8, gamma=0 -> 0.05 s
    return LatencyProfile(name, {Cell(b, 0, g): scale[g] * (0.01 + 0.005 * b)
                                 for b in grid.batch_sizes for g in grid.gammas})


def accuracy_profile(name="vit", acc=ACC) -> AccuracyProfile:
    return AccuracyProfile(name, {(t, g): a for t, row in acc.items() for g, a in row.items()})


LAT, ACCP = latency_profile(), accuracy_profile()


def req(i, t, deadline=math.inf, utility=1.0, task="c10"):
    return Request(id=i, arrival=t, model="vit", task=task, deadline=deadline, utility=utility)


# --------------------------------------------------------------------------- Alg. 2


def brute_force(deadlines, options, start, executors=1):
    """Max utility over all assignments (None = skip), ties -> earlier finish. ``executors`` m: the
    batches share m executors, so a batch started at clock c must finish, c + t, before its
    deadline and moves the clock to c + t / m (m = 1: one batch after another)."""
    best = None
    for choice in itertools.product(*[[None, *range(len(o))] for o in options]):
        clock, utility, ok = start, 0.0, True
        for d, opts, k in zip(deadlines, options, choice):
            if k is None:
                continue
            if not clock + opts[k].seconds < d:
                ok = False
                break
            clock += opts[k].seconds / executors
            utility += opts[k].utility
        if ok and (best is None or utility > best[0] or (utility == best[0] and clock < best[1])):
            best = (utility, clock)
    return best


def evaluate(deadlines, options, start, gammas):
    clock, utility = start, 0.0
    for d, opts, g in zip(deadlines, options, gammas):
        if g is None:
            continue
        o = next(o for o in opts if o.gamma == g)
        clock += o.seconds
        assert clock < d, "DP executed a batch past its deadline"
        utility += o.utility
    return utility, clock


def test_dp_equals_brute_force_on_random_instances():
    rng = random.Random(7)
    ties = 0
    for _ in range(400):
        n = rng.randint(1, 5)
        g = rng.randint(1, 4)
        start = rng.choice([0.0, 1.0])
        # Quarter/eighth grids make sums exact in binary, so utility and clock ties are real.
        options = [[GammaOption(gamma, rng.randint(1, 8) / 8, rng.randint(0, 8) / 4) for gamma in range(g)]
                   for _ in range(n)]
        deadlines = sorted(start + rng.randint(1, 4 * n) / 4 for _ in range(n))
        sol = solve_token_dp(deadlines, options, start)
        expect = brute_force(deadlines, options, start)
        assert not sol.truncated
        assert (sol.utility, sol.finish) == expect
        assert evaluate(deadlines, options, start, sol.gammas) == expect
        ties += sum(1 for o in options if len({x.utility for x in o}) < len(o))
    assert ties > 50  # the generator really produced tie situations


def test_dp_on_shared_executors_by_hand_and_by_brute_force():
    """Three batches, each at gamma 8 (0.2 s, utility 0.98) or -10 (0.05 s, 0.80), all due 0.3 s
    after the start. One executor: a gamma-8 batch leaves room for one more batch at most
    (0.2 + 0.05 + 0.05 = 0.3 is not < 0.3), so all three at -10 (2.4) is the best. Three
    executors sharing the clock: batch 1 at 8 moves it to 0.0667, batch 2 at 8 finishes at
    0.2667 and moves it to 0.1333, batch 3 at 8 would finish at 0.3333: two at 8 and one at -10
    (2.76). Then random queues: the DP equals brute force over every assignment in that model."""
    opts = [GammaOption(8, 0.2, 0.98), GammaOption(-10, 0.05, 0.80)]
    one = solve_token_dp([0.3] * 3, [opts] * 3, 0.0)
    assert one.gammas == (-10, -10, -10) and one.utility == pytest.approx(2.4)
    three = solve_token_dp([0.3] * 3, [opts] * 3, 0.0, executors=3)
    assert sorted(three.gammas) == [-10, 8, 8] and three.utility == pytest.approx(2.76)
    assert three.finish == pytest.approx(0.15)
    with pytest.raises(ValueError, match="executors must be an integer >= 1"):
        solve_token_dp([0.3], [opts], 0.0, executors=0)
    rng = random.Random(8)
    for _ in range(300):
        n, g, m = rng.randint(1, 5), rng.randint(1, 4), rng.choice([2, 3, 4])
        start = rng.choice([0.0, 1.0])
        # eighths and quarters, so that shares of m in {2, 4} are exact: ties are real there
        options = [[GammaOption(gamma, rng.randint(1, 8) / 8, rng.randint(0, 8) / 4) for gamma in range(g)]
                   for _ in range(n)]
        deadlines = sorted(start + rng.randint(1, 2 * n) / 4 for _ in range(n))
        sol = solve_token_dp(deadlines, options, start, executors=m)
        utility, clock = brute_force(deadlines, options, start, m)
        assert not sol.truncated
        assert sol.utility == pytest.approx(utility, abs=1e-12) and sol.finish == pytest.approx(clock, abs=1e-12)


def test_dp_tie_prefers_earlier_clock():
    # One batch: two gammas with the same utility -> the faster one.
    opts = [[GammaOption(2, 0.4, 1.0), GammaOption(-5, 0.1, 1.0)]]
    sol = solve_token_dp([10.0], opts, 0.0)
    assert sol.gammas == (-5,) and sol.finish == 0.1
    # Two batches whose plans tie on utility: (A fast, B slow) vs (A slow, B fast) vs both
    # medium; the earliest total clock wins.
    a = [GammaOption(0, 0.5, 1.0), GammaOption(8, 0.25, 1.0)]
    b = [GammaOption(0, 0.5, 2.0), GammaOption(8, 0.375, 2.0)]
    sol = solve_token_dp([5.0, 5.0], [a, b], 0.0)
    assert sol.gammas == (8, 8) and sol.finish == 0.625 and sol.utility == 3.0


def test_zero_utility_path_never_beats_a_feasible_one():
    # The paper's init (dp=0, C=T) lets a zero-utility execution keep clock T for free and
    # argmax over a row of zeros return it. Batch 1 is worth nothing and slow; batch 2 is
    # feasible only if batch 1 is skipped.
    opts = [[GammaOption(0, 0.8, 0.0)], [GammaOption(0, 0.5, 0.6)]]
    sol = solve_token_dp([1.0, 1.0], opts, 0.0)
    assert sol.gammas == (None, 0) and sol.utility == 0.6 and sol.finish == 0.5
    # All-zero utility: nothing is executed, clock stays at the start.
    sol = solve_token_dp([1.0], [[GammaOption(0, 0.2, 0.0)]], 3.0)
    assert sol.gammas == (None,) and sol.utility == 0.0 and sol.finish == 3.0
    # A feasible positive plan always beats the empty one, whatever the option order.
    for perm in itertools.permutations([GammaOption(-5, 0.1, 0.0), GammaOption(0, 0.2, 0.3),
                                        GammaOption(8, 2.0, 0.9)]):
        sol = solve_token_dp([1.0], [list(perm)], 0.0)
        assert sol.gammas == (0,) and sol.utility == 0.3


def test_dp_infeasible_batch_is_not_executed_and_low_value_batch_is_dropped():
    # Batch 1 cannot meet its deadline at any gamma -> l_b = 0.
    opts = [[GammaOption(-5, 0.3, 1.0), GammaOption(0, 0.5, 1.2)], [GammaOption(0, 0.2, 1.0)]]
    sol = solve_token_dp([0.25, 2.0], opts, 0.0)
    assert sol.gammas == (None, 0)
    # Batch 1 is cheap in value; running it would make batch 2 (worth more) miss.
    opts = [[GammaOption(0, 0.5, 0.1)], [GammaOption(0, 0.6, 5.0)]]
    sol = solve_token_dp([1.0, 1.0], opts, 0.0)
    assert sol.gammas == (None, 0) and sol.utility == 5.0


def one_label_per_gamma_dp(deadlines, options, start):
    """The paper's table: one (utility, clock) per (b, l_b), higher utility kept (with
    -inf for absent states and the earlier clock on ties, i.e. fixes 1 and 2 only)."""
    row = {0: (0.0, start)}
    for d, opts in zip(deadlines, options):
        new = {0: max(row.values(), key=lambda uc: (uc[0], -uc[1]))}
        for lb, o in enumerate(opts, start=1):
            cands = [(u + o.utility, c + o.seconds) for u, c in row.values() if c + o.seconds < d]
            if cands:
                new[lb] = max(cands, key=lambda uc: (uc[0], -uc[1]))
        row = new
    return max(row.values(), key=lambda uc: (uc[0], -uc[1]))


def test_dp_is_exact_where_one_label_per_gamma_is_not():
    # Optimum: batch 1 at its fast, lower-utility gamma so that batches 2 and 3 both fit.
    # The (b, l_b) table keeps only the best-utility prefix reaching (2, run) — batch 1
    # slow, finishing at 1.0 — and batch 3 then misses its deadline.
    b1 = [GammaOption(-5, 0.25, 1.0), GammaOption(8, 0.75, 1.5)]
    b2 = [GammaOption(0, 0.25, 1.0)]
    b3 = [GammaOption(0, 0.25, 1.0)]
    deadlines = [1.0, 1.2, 1.2]  # EDD order
    assert one_label_per_gamma_dp(deadlines, [b1, b2, b3], 0.0) == (2.5, 1.0)
    sol = solve_token_dp(deadlines, [b1, b2, b3], 0.0)
    assert sol.gammas == (-5, 0, 0) and (sol.utility, sol.finish) == (3.0, 0.75)
    assert (sol.utility, sol.finish) == brute_force(deadlines, [b1, b2, b3], 0.0)


def test_dp_frontier_truncation_is_reported():
    rng = random.Random(3)
    options = [[GammaOption(g, rng.random(), rng.random()) for g in range(4)] for _ in range(12)]
    sol = solve_token_dp([1e9] * 12, options, 0.0, max_labels=4)
    assert sol.truncated and sol.max_frontier == 4
    assert all(g is not None for g in sol.gammas)  # infinite slack: everything runs


# --------------------------------------------------------------------------- Alg. 3


def test_load_map_from_profile_picks_expected_gammas():
    f = LoadToGamma.from_profile(LAT, ACCP, GRID, GAMMAS, headroom=0.8)
    # sustainable rates: 0.8 * 8 / latency(8, g) = 256, 170.7, 128, 102.4, 64 req/s
    rates = {g: r for g, r, _ in f.rows}
    assert rates[8] == pytest.approx(64) and rates[-10] == pytest.approx(256)
    assert [f(q) for q in (0, 10, 60, 70, 100, 110, 125, 150, 200, 250, 400)] == \
        [8, 8, 8, 2, 2, 0, 0, -5, -10, -10, -10]
    assert [g for _, g in f.table()] == [8, 2, 0, -5, -10]


def test_load_map_prefers_accuracy_not_gamma_order():
    # A profile where prompts do not help: gamma 2 is slower and no more accurate than 0.
    acc = accuracy_profile(acc={"c10": {-10: 0.8, -5: 0.9, 0: 0.95, 2: 0.95, 8: 0.94}})
    f = LoadToGamma.from_profile(LAT, acc, GRID, GAMMAS)
    assert f(10) == 0


def test_manual_allocate_branches():
    def opts(scale=1.0):
        return [GammaOption(g, SCALE[g] * 0.1 * scale, ACC["c10"][g]) for g in GAMMAS]

    # (deadline, mean utility): fits at f(q)=0 -> 0; misses at f(q) -> min gamma;
    # critical (mean u > kappa) -> most accurate gamma that still fits.
    gammas = manual_allocate(
        deadlines=[10.0, 10.08, 11.0],
        mean_utilities=[0.3, 0.3, 0.9],
        options=[opts(), opts(), opts()],
        start=10.0, load_gamma=0, kappa=0.8)
    # batch 1: 10 + 0.1 < 10.0? no -> -10 (t = 0.05, clock 10.05)
    # batch 2: 10.05 + 0.1 >= 10.08 -> -10 (clock 10.10)
    # batch 3: fits; critical -> gamma 8 (10.10 + 0.2 < 11)
    assert gammas == (-10, -10, 8)
    # Plain batch with slack gets f(q); a critical batch whose max gamma would miss gets
    # the most accurate gamma that fits (2: 0.125 s), not max(L) (8: 0.2 s).
    assert manual_allocate([5.0], [0.1], [opts()], 0.0, load_gamma=-5, kappa=0.8) == (-5,)
    assert manual_allocate([0.15], [1.0], [opts()], 0.0, load_gamma=0, kappa=0.8) == (2,)


def test_a_critical_batch_gets_the_most_accurate_gamma_the_load_sustains():
    """Alg. 3's max(L) branch (module docstring): among gammas that meet d_b, only those the load
    map says sustain q, and f(q) itself. At 110 req/s (LoadToGamma rows above: 0 sustains 128,
    2 sustains 102.4, 8 sustains 64) f(q) = 0 and gamma 0 and the faster gammas sustain q."""
    f = LoadToGamma.from_profile(LAT, ACCP, GRID, GAMMAS, headroom=0.8)
    assert f.sustaining(110) == {-10, -5, 0} and f(110) == 0
    assert f.sustaining(300) == frozenset() and f.sustaining(0) == set(GAMMAS)
    opts = [GammaOption(g, SCALE[g] * 0.05, ACC["c100"][g]) for g in GAMMAS]
    # no bound: the most accurate gamma that fits, 8; bounded: 0, the most accurate sustaining one
    assert manual_allocate([10.0], [1.0], [opts], 0.0, load_gamma=0, kappa=0.8) == (8,)
    assert manual_allocate([10.0], [1.0], [opts], 0.0, load_gamma=0, kappa=0.8, sustaining=f.sustaining(110)) == (0,)
    # at a load every gamma sustains, the bound changes nothing
    assert manual_allocate([10.0], [1.0], [opts], 0.0, load_gamma=8, kappa=0.8, sustaining=f.sustaining(10)) == (8,)
    # where no gamma sustains q, f(q) (the fastest) is still allowed, and chosen
    assert manual_allocate([10.0], [1.0], [opts], 0.0, load_gamma=-10, kappa=0.8, sustaining=f.sustaining(300)) \
        == (-10,)
    # a non-critical batch is f(q)'s whatever the bound
    assert manual_allocate([10.0], [0.5], [opts], 0.0, load_gamma=0, kappa=0.8, sustaining=frozenset()) == (0,)


def test_the_policy_bounds_a_critical_batch_by_the_rate_it_reads():
    """OTASPolicy hands Alg. 3 the gammas that sustain the rate it measured: critical requests
    (utility 1 > kappa) run at the most accurate gamma, 8, at a trickle, and never above f(q)'s
    accuracy when 110 req/s arrive (f(q) = 0; 2 and 8 cannot sustain it)."""
    def run(rate, n):
        # n arrivals, evenly spaced, then a plan: the 0.25 s window reads about ``rate``, and
        # n <= 40 requests make at most beta = 5 batches of 8, so Alg. 3 plans them
        p = otas(params=OTASParams(rate_window=0.25))
        p.start_time = -10.0  # past the initial stage
        for i in range(n):
            p.on_arrival(req(i, i / rate, deadline=i / rate + 5.0, utility=1.0, task="c100"), i / rate)
        plan = p.plan(n / rate, [0])
        assert plan.batches and p.counters["alg3_runs"] == 1 and p.counters["dp_runs"] == 0
        return plan.batches[0].cell.gamma
    assert run(5, 3) == 8
    assert run(110, 28) == 0


def test_alg3_reads_one_instance_s_share_of_the_rate():
    """199 req/s over four instances is 49.75 req/s each, which gamma 8 sustains (64 req/s at
    headroom 0.8, test_load_map_from_profile_picks_expected_gammas): the first four batches of
    Alg. 3 run at 8. Planned for one executor (share_instances=False), 199 req/s is beyond what
    any gamma but -10 sustains (256), so they run at -10."""
    for share, want in ((True, 8), (False, -10)):
        p = otas(params=OTASParams(initial_stage=1e9, share_instances=share))
        for i in range(200):
            p.on_arrival(req(i, i / 200, utility=0.1), i / 200)
        plan = p.plan(1.0, [0, 1, 2, 3])
        assert len(plan.batches) == 4 and p.counters["alg3_runs"] == 1
        assert [b.cell.gamma for b in plan.batches] == [want] * 4, share
        assert p.executors == 4 and p.backlog == 0.0


def test_a_plan_counts_busy_and_idle_instances_and_the_work_still_running():
    """``executors`` counts each instance once, busy or idle, an idle one whose completion was not
    reported included; ``backlog`` is the work estimated still to run on the busy ones only (an
    estimate already past counts 0)."""
    p = otas(params=OTASParams(initial_stage=1e9))
    for i in range(80):  # ten batches of eight: some stay queued, so that each plan below plans
        p.on_arrival(req(i, 0.0, utility=0.1), 0.0)
    first = p.plan(0.0, [0, 1, 2])
    assert len(first.batches) == 3
    ends = {b.instance: p._pricer.seconds(len(b.request_ids), b.cell.gamma) for b in first.batches}
    now = min(ends.values()) / 2
    p.plan(now, [1, 3])  # 1's completion not reported: idle all the same; 3 is new
    assert p.executors == 4
    assert p.backlog == pytest.approx(ends[0] - now + ends[2] - now)
    later = max(ends.values()) + 1.0  # every estimate past (none reported): nothing left to run
    p.plan(later, [5])
    assert p.executors == 5 and p.backlog == 0.0  # 0 to 3 busy as far as it knows, and 5


# --------------------------------------------------------------------------- Alg. 1


def otas(**kw):
    return OTASPolicy("vit", LAT, ACCP, GRID, **kw)


def test_batching_respects_delta():
    p = otas(batching=BatchingParams(delta=0.5, epsilon=64, eta=10, mu=0.0))
    p.on_arrival(req(0, 0.0, deadline=5), 0.0)
    p.on_arrival(req(1, 0.49, deadline=5), 0.49)  # first request waited 0.49 < 0.5
    p.on_arrival(req(2, 0.5, deadline=5), 0.5)  # waited 0.5: batch closed to joins
    assert p.queued_batches() == ((0, 1), (2,))


def test_batching_respects_epsilon_and_grid_cap():
    p = otas(batching=BatchingParams(delta=10, epsilon=3, eta=10, mu=0.0))
    for i in range(7):
        p.on_arrival(req(i, 0.0, deadline=5), 0.0)
    assert p.queued_batches() == ((0, 1, 2), (3, 4, 5), (6,))
    p = otas(batching=BatchingParams(delta=10, epsilon=64, eta=10, mu=0.0))  # grid max is 8
    for i in range(10):
        p.on_arrival(req(i, 0.0, deadline=5), 0.0)
    assert [len(b) for b in p.queued_batches()] == [8, 2]


def test_batching_respects_eta():
    p = otas(batching=BatchingParams(delta=10, epsilon=64, eta=0.5, mu=0.0))
    p.on_arrival(req(0, 0.0, deadline=1.0), 0.0)
    p.on_arrival(req(1, 0.0, deadline=1.5), 0.0)  # |1.5 - 1.0| = 0.5 <= eta
    p.on_arrival(req(2, 0.0, deadline=1.6), 0.0)  # 0.6 from d_b = 1.0
    p.on_arrival(req(3, 0.0, deadline=0.6), 0.0)  # 0.4 before d_b: joins, d_b -> 0.6
    p.on_arrival(req(4, 0.0, deadline=1.2), 0.0)  # 0.6 from the new d_b -> batch 2
    assert p.queued_batches() == ((0, 1, 3), (2, 4))


def test_batching_respects_mu_as_ratio_to_first_utility():
    p = otas(batching=BatchingParams(delta=10, epsilon=64, eta=10, mu=0.8))
    p.on_arrival(req(0, 0.0, deadline=5, utility=0.3), 0.0)
    p.on_arrival(req(1, 0.0, deadline=5, utility=0.25), 0.0)  # 0.83 >= 0.8
    p.on_arrival(req(2, 0.0, deadline=5, utility=0.2), 0.0)  # 0.67 vs u_b = 0.3
    p.on_arrival(req(3, 0.0, deadline=5, utility=0.01), 0.0)
    p.on_arrival(req(4, 0.0, deadline=5, utility=0.0), 0.0)
    p.on_arrival(req(5, 0.0, deadline=5, utility=0.0), 0.0)
    assert p.queued_batches() == ((0, 1), (2,), (3,), (4, 5))


# --------------------------------------------------------------------------- policy


def drive(policy, requests, instances=(0,), slowdown=lambda i: 1.0, price=None, check=None):
    """A tiny discrete-event loop with a fake clock; returns (batches, evicted ids).

    A batch runs for ``price(batch)`` (default: its cell's profiled latency) times
    ``slowdown(index of the batch)``.
    """
    price = price or (lambda b: LAT.latency(b.cell))
    pending = sorted(requests, key=lambda r: r.arrival)
    running = {}  # instance -> (finish, batch)
    batches, evicted = [], []
    now, wake, steps = 0.0, math.inf, 0
    while pending or running or policy.queue_depth():
        steps += 1
        assert steps < 100_000
        t_arr = pending[0].arrival if pending else math.inf
        t_done = min((f for f, _ in running.values()), default=math.inf)
        now = min(t_arr, t_done, wake)
        assert now < math.inf, "policy holds requests with nothing left to wake it"
        for inst, (f, b) in list(running.items()):
            if f <= now:
                del running[inst]
                policy.on_completion(b, now)
        while pending and pending[0].arrival <= now:
            policy.on_arrival(pending.pop(0), now)
        idle = [i for i in instances if i not in running]
        plan = policy.plan(now, idle)
        wake = plan.wake_at
        evicted.extend(plan.evict)
        for b in plan.batches:
            assert b.instance in idle and b.instance not in running
            if check:
                check(b)
            running[b.instance] = (now + price(b) * slowdown(len(batches)), b)
            batches.append(b)
    return batches, evicted


def bursty_requests(seed, n=400):
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        rate = 400.0 if (t % 2.0) > 1.2 else 60.0  # bursts above capacity, then calm
        t += rng.expovariate(rate)
        task, slo, u = rng.choice([("c10", 0.3, 0.3), ("c10", 0.6, 0.01), ("c100", 0.3, 1.0),
                                   ("c100", 0.6, 0.2)])
        out.append(req(i, t, deadline=t + slo, utility=u, task=task))
    return out


def check_cell(policy, grid=GRID):
    def check(b):
        assert b.cell == grid.cell_for(len(b.request_ids), 0, b.cell.gamma)
    return check


@pytest.mark.parametrize("instances", [(0,), (0, 1)])
def test_otas_never_loses_a_request(instances):
    requests = bursty_requests(1)
    p = otas()
    batches, evicted = drive(p, requests, instances, slowdown=lambda i: 2.0 if i % 7 == 0 else 1.0,
                             check=check_cell(p))
    ids = [i for b in batches for i in b.request_ids] + evicted
    assert sorted(ids) == [r.id for r in requests]  # each id exactly once
    assert set(p.outcomes) == {r.id for r in requests}
    assert {p.outcomes[i] for i in evicted} == {OutcomeType.EVICTED}
    served = {i for b in batches for i in b.request_ids}
    assert all(p.outcomes[i] in (OutcomeType.ACCURATE_ON_TIME, OutcomeType.LATE) for i in served)
    assert all(p.request_gamma[i] == b.cell.gamma for b in batches for i in b.request_ids)
    assert p.counters["alg3_runs"] > 0 and p.counters["dp_runs"] > 0  # both paths exercised
    assert p.counters["late"] > 0 and p.counters["evicted"] > 0  # the run was really stressed
    assert len({b.cell.gamma for b in batches}) > 1  # adapts gamma
    assert p.queue_depth() == 0


def test_otas_uses_alg3_in_initial_stage_and_dp_after():
    p = otas(batching=BatchingParams(delta=10, epsilon=1, eta=10, mu=0.0),
             params=OTASParams(beta=2, initial_stage=2.0), start_time=0.0)
    for i in range(4):
        p.on_arrival(req(i, 1.0, deadline=100.0), 1.0)
    plan = p.plan(1.0, [0])
    assert p.decisions[-1].source == "load" and len(plan.batches) == 1
    for i in range(4, 8):
        p.on_arrival(req(i, 3.0, deadline=100.0), 3.0)
    p.on_completion(plan.batches[0], 3.0)
    p.plan(3.0, [0])  # 6 batches > beta, past the initial stage
    assert p.decisions[-1].source == "dp"
    assert p.decisions[-1].gamma == 8  # slack everywhere: most accurate gamma


def test_hopeless_requests_are_evicted_with_type_4():
    p = otas(start_time=0.0)
    p.on_arrival(req(0, 0.0, deadline=0.004), 0.0)  # fastest run takes 0.0075 s
    p.on_arrival(req(1, 0.0, deadline=1.0, utility=0.9), 0.0)
    plan = p.plan(0.0, [0])
    assert plan.evict == (0,) and p.outcomes[0] == OutcomeType.EVICTED
    assert [b.request_ids for b in plan.batches] == [(1,)]
    # q = 2 req / 0.1 s = 20 req/s -> f(q) = 8: request 1 runs 0.03 s at gamma 8.
    assert plan.batches[0].cell == Cell(1, 0, 8)
    # With no idle instance the start is the busy instance's estimated finish: 0.03 +
    # 0.0075 >= 0.035 although 0.0075 alone would have fit.
    p.on_arrival(req(2, 0.0, deadline=0.035), 0.0)
    busy = p.plan(0.0, [])
    assert busy.evict == (2,) and busy.batches == ()


def test_outcome_types_1_2_3():
    p = otas(start_time=0.0)
    p.on_arrival(req(0, 0.0, deadline=0.5), 0.0)
    (b,) = p.plan(0.0, [0]).batches
    p.on_completion(b, 0.4)
    assert p.outcomes[0] == OutcomeType.ACCURATE_ON_TIME
    p.record_correctness(0, False)
    assert p.outcomes[0] == OutcomeType.INACCURATE_ON_TIME
    p.on_arrival(req(1, 1.0, deadline=1.5), 1.0)
    (b,) = p.plan(1.0, [0]).batches
    p.on_completion(b, 1.6)
    assert p.outcomes[1] == OutcomeType.LATE
    p.record_correctness(1, False)
    assert p.outcomes[1] == OutcomeType.LATE


def test_wake_at_lets_caller_evict_deferred_request():
    # A zero-utility request on an otherwise empty queue is backfilled, not held forever.
    p = otas(params=OTASParams(beta=0, initial_stage=0.0), start_time=0.0)
    p.on_arrival(req(0, 0.0, deadline=1.0, utility=0.0), 0.0)
    plan = p.plan(0.0, [0])
    assert [b.request_ids for b in plan.batches] == [(0,)] and p.decisions[-1].source == "backfill"


# --------------------------------------------------------------------------- baselines


def test_fixed_gamma_baselines_pick_their_gammas():
    requests = bursty_requests(2, n=150)
    for policy, gamma in [(PetSPolicy("vit", LAT, ACCP, GRID), 0),
                          (FixedToMePolicy("vit", LAT, ACCP, GRID, gamma=-10), -10),
                          (FixedVPTPolicy("vit", LAT, ACCP, GRID), 2)]:
        batches, evicted = drive(policy, requests, check=check_cell(policy))
        assert {b.cell.gamma for b in batches} == {gamma}
        assert sorted([i for b in batches for i in b.request_ids] + evicted) == [r.id for r in requests]
    with pytest.raises(ValueError):
        FixedToMePolicy("vit", LAT, ACCP, GRID, gamma=2)


def variants():
    grid = ShapeGrid(batch_sizes=(1, 4, 8), gammas=(0,))
    out = []
    for name, scale, acc in [("vit-s", 0.5, 0.85), ("vit-b", 1.0, 0.93), ("vit-l", 3.0, 0.97)]:
        lat = LatencyProfile(name, {Cell(b, 0, 0): scale * (0.01 + 0.005 * b) for b in grid.batch_sizes})
        accp = AccuracyProfile(name, {("c10", 0): acc, ("c100", 0): acc - 0.1})
        out.append(ModelVariant(name, lat, accp, grid))
    return out


def test_infaas_switches_variant_with_load_and_pays_switch_cost():
    # Sustainable rates (headroom 0.8, batch 8): S 256, B 128, L 42.7 req/s.
    p = INFaaSPolicy(variants(), switch_seconds=0.3, decision_interval=1.0, start_time=0.0)
    assert p.current_variant == "vit-l"  # idle: most accurate
    for i in range(5):  # 5 req in 0.05 s -> 50 req/s: L cannot keep up, B can
        p.on_arrival(req(i, 0.01 * i, deadline=10.0), 0.01 * i)
    plan = p.plan(0.05, [0])
    assert plan.batches == () and p.current_variant == "vit-b" and plan.wake_at == pytest.approx(0.35)
    assert p.plan(0.2, [0]).batches == ()  # still loading
    plan = p.plan(0.35, [0])
    assert [b.model for b in plan.batches] == ["vit-b"] and plan.batches[0].cell.gamma == 0
    assert p.counters["switches"] == 1


def test_infaas_compares_one_instance_s_share_of_the_rate_with_a_variant_s_throughput():
    """50 req/s is beyond L's 42.7 req/s but, spread over two instances, 25 req/s each is not: with
    two instances the policy stays on L; with one it switches to B (the test above)."""
    p = INFaaSPolicy(variants(), switch_seconds=0.3, decision_interval=1.0, start_time=0.0)
    for i in range(5):  # 5 req in 0.05 s -> 50 req/s
        p.on_arrival(req(i, 0.01 * i, deadline=10.0), 0.01 * i)
    plan = p.plan(0.05, [0, 1])
    assert p.executors == 2 and p.current_variant == "vit-l" and p.counters["switches"] == 0
    assert [b.model for b in plan.batches] == ["vit-l"]  # one batch of five, on the first idle instance


def test_infaas_never_loses_a_request():
    vs = variants()
    by_name = {v.name: v.latency for v in vs}
    p = INFaaSPolicy(vs, switch_seconds=0.2)
    requests = bursty_requests(3, n=300)
    batches, evicted = drive(p, requests, price=lambda b: by_name[b.model].latency(b.cell))
    assert sorted([i for b in batches for i in b.request_ids] + evicted) == [r.id for r in requests]
    assert len({b.model for b in batches}) >= 2 and p.counters["switches"] >= 1


def _second_at_rate(p, second, rate, first_id):
    """``rate`` arrivals spread over (second - 1, second] (no deadline), then one plan at
    ``second``: the policy's measured rate there is ``rate`` (1 s window). Returns (plan, next id)."""
    for k in range(rate):
        t = second - 1 + (k + 1) / rate
        p.on_arrival(req(first_id + k, t), t)
    return p.plan(float(second), [0]), first_id + rate


def test_infaas_pays_the_target_variants_own_switch_cost():
    """Switching to a variant blocks every batch until clock + that variant's cost (not one cost
    for all), and a forced switch (the current variant cannot sustain the rate) is not held back
    by the default hold of 20 decisions."""
    costs = {"vit-s": 0.2, "vit-b": 0.7, "vit-l": 1.5}
    p = INFaaSPolicy(variants(), switch_seconds=costs, decision_interval=1.0, start_time=0.0)
    assert p.hold == 20 and p.switch_costs == costs and p.current_variant == "vit-l"  # loaded for free
    plan, i = _second_at_rate(p, 1, 60, 0)  # L sustains 42.7 req/s: forced, to B (128)
    assert plan.batches == () and p.current_variant == "vit-b" and plan.wake_at == pytest.approx(1.7)
    assert p.plan(1.69, [0]).batches == ()  # still loading B
    assert [b.model for b in p.plan(1.7, [0]).batches] == ["vit-b"]
    assert p.loading_seconds == pytest.approx(0.7)
    plan, i = _second_at_rate(p, 3, 200, i)  # B cannot sustain 200: forced, to S (256)
    assert plan.batches == () and p.current_variant == "vit-s" and plan.wake_at == pytest.approx(3.2)
    assert p.plan(3.19, [0]).batches == () and [b.model for b in p.plan(3.2, [0]).batches] == ["vit-s"]
    assert p.loading_seconds == pytest.approx(0.9)
    assert p.counters["switches"] == p.counters["switches_forced"] == 2


def test_infaas_hysteresis_ignores_an_oscillating_rate_but_follows_a_sustained_fall():
    """The rate alternates each second between 100 req/s (B's: L cannot sustain it) and 30 req/s
    (L's, but B keeps up). With hold 4 the policy moves to B once (forced) and stays; without
    hysteresis (hold 1) it flaps every second. A fall to 30 req/s that lasts 4 decisions then moves
    it to L at the 4th (elective)."""
    def run(hold):
        p = INFaaSPolicy(variants(), switch_seconds=0.0, decision_interval=1.0, start_time=0.0, hold=hold)
        i, seen = 0, []
        for second in range(1, 20):  # odd seconds 100 req/s, even ones 30, ending on 100
            _, i = _second_at_rate(p, second, 100 if second % 2 else 30, i)
            seen.append(p.current_variant)
        return p, seen, i

    flappy, seen, _ = run(1)
    assert flappy.counters["switches"] == 19 and seen[:4] == ["vit-b", "vit-l", "vit-b", "vit-l"]
    p, seen, i = run(4)
    assert seen == ["vit-b"] * 19 and p.counters["switches"] == p.counters["switches_forced"] == 1
    for second in range(20, 23):  # calm: L is the choice, B still sustains it
        _, i = _second_at_rate(p, second, 30, i)
        assert p.current_variant == "vit-b"
    _, i = _second_at_rate(p, 23, 30, i)
    assert p.current_variant == "vit-l" and p.counters["switches_elective"] == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(switch_seconds=-0.1), "switch_seconds must be a finite number >= 0"),
    (dict(switch_seconds=float("nan")), "switch_seconds must be a finite number >= 0"),
    (dict(switch_seconds=math.inf), "switch_seconds must be a finite number >= 0"),
    (dict(switch_seconds={"vit-s": 0.1, "vit-b": 0.2}), r"missing \['vit-l'\]"),
    (dict(switch_seconds={"vit-s": 0.1, "vit-b": 0.2, "vit-l": 0.3, "vit-h": 0.4}), r"unknown \['vit-h'\]"),
    (dict(switch_seconds={"vit-s": 0.1, "vit-b": -1.0, "vit-l": 0.3}), r"switch_seconds\['vit-b'\]"),
    (dict(switch_seconds={"vit-s": 0.1, "vit-b": float("nan"), "vit-l": 0.3}), r"switch_seconds\['vit-b'\]"),
    (dict(switch_seconds=0.1, hold=0), "hold must be an integer >= 1"),
    (dict(switch_seconds=0.1, hold=2.5), "hold must be an integer >= 1"),
    (dict(switch_seconds=0.1, decision_interval=-1.0), "decision_interval"),
])
def test_infaas_refuses_bad_switch_costs_and_hold_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        INFaaSPolicy(variants(), **kwargs)


# --------------------------------------------------------------------------- serving glue


class _Runtime:
    """What make_otas_policy reads of a model runtime: its grid, served task heads, accuracy."""

    def __init__(self, accuracy, heads=("c10", "c100"), grid=GRID):
        self.grid, self.accuracy, self.heads = grid, accuracy, {t: None for t in heads}


def test_make_otas_policy_refuses_an_accuracy_profile_with_holes():
    from jaxserve.sched.base import CostModel
    from jaxserve.sched.otas import make_otas_policy

    cost = CostModel(latency={"vit": LAT})
    holes = {**ACC, "c100": {g: a for g, a in ACC["c100"].items() if g not in (-5, 8)}}
    with pytest.raises(ValueError, match=r"'c100' at gammas \[-5, 8\]"):
        make_otas_policy("otas", {"vit": _Runtime(accuracy_profile(acc=holes))}, cost)
    # A served task (a runtime head) the profile does not know at all.
    with pytest.raises(ValueError, match=r"'svhn' at gammas \[-10, -5, 0, 2, 8\]"):
        make_otas_policy("otas", {"vit": _Runtime(ACCP, heads=("c10", "c100", "svhn"))}, cost)
    # A fixed-gamma policy only needs its own gamma: PetS runs at 0, which c100 still has.
    assert isinstance(make_otas_policy("pets", {"vit": _Runtime(accuracy_profile(acc=holes))}, cost), PetSPolicy)
    with pytest.raises(ValueError, match=r"'c100' at gammas \[8\]"):
        make_otas_policy("vpt", {"vit": _Runtime(accuracy_profile(acc=holes))}, cost, {"vpt_gamma": 8})
    # Covered: every request is planned (no KeyError at plan time).
    policy = make_otas_policy("otas", {"vit": _Runtime(ACCP)}, cost)
    policy.on_arrival(req(0, 0.0, task="c100"), 0.0)
    assert [b.request_ids for b in policy.plan(0.0, [0]).batches] == [(0,)]
    # where the profile came from decides whether a reload may replace it (jaxserve.launch.reload_assets)
    assert policy.accuracy_source == "repository"
    profiled = CostModel(latency={"vit": LAT}, accuracy={"vit": ACCP})
    assert make_otas_policy("otas", {"vit": _Runtime(None)}, profiled).accuracy_source == "cost model"


def test_use_accuracy_replans_with_the_new_profile():
    """A reload's profile takes over the next decisions: the pricer and Alg. 3's load map are
    rebuilt from it (a flat 0.5 everywhere gives a map whose every row says 0.5), after
    check_coverage has accepted it for the served tasks (and refused a task it lacks)."""
    from jaxserve.sched.base import CostModel
    from jaxserve.sched.otas import check_coverage, make_otas_policy

    cost = CostModel(latency={"vit": LAT})
    policy = make_otas_policy("otas", {"vit": _Runtime(ACCP)}, cost)
    flat = accuracy_profile(acc={t: {g: 0.5 for g in accs} for t, accs in ACC.items()})
    check_coverage(policy, flat, ("c10", "c100"))
    with pytest.raises(ValueError, match="'svhn'"):
        check_coverage(policy, flat, ("svhn",))
    rows = policy.load_map.rows
    policy.use_accuracy(flat)
    assert policy._pricer.accuracy is flat and policy.load_map.rows != rows
    assert {a for _, _, a in policy.load_map.rows} == {0.5}


def test_make_otas_policy_takes_explicit_gammas_literally():
    from jaxserve.sched.base import CostModel
    from jaxserve.sched.otas import make_otas_policy

    cost = CostModel(latency={"vit": LAT})
    rt = {"vit": _Runtime(ACCP)}
    assert make_otas_policy("tome", rt, cost).gamma == -10  # default: the most negative
    assert make_otas_policy("tome", rt, cost, {"tome_gamma": None}).gamma == -10  # the CLI's "not given"
    assert make_otas_policy("tome", rt, cost, {"tome_gamma": -5}).gamma == -5
    assert make_otas_policy("vpt", rt, cost).gamma == 2
    assert make_otas_policy("vpt", rt, cost, {"vpt_gamma": 8}).gamma == 8
    # gamma 0 is neither ToMe nor VPT: refused, not silently replaced by the default.
    with pytest.raises(ValueError, match="negative"):
        make_otas_policy("tome", rt, cost, {"tome_gamma": 0})
    with pytest.raises(ValueError, match="positive"):
        make_otas_policy("vpt", rt, cost, {"vpt_gamma": 0})
    with pytest.raises(ValueError, match=r"tome_gamma=-3 is not a gamma of the grid"):
        make_otas_policy("tome", rt, cost, {"tome_gamma": -3})
    with pytest.raises(ValueError, match=r"vpt_gamma=4 is not a gamma of the grid"):
        make_otas_policy("vpt", rt, cost, {"vpt_gamma": 4})


def test_vpt_default_is_the_grids_smallest_prompt_count_where_2_is_not_served():
    """DINOv2's grid has prompts at +4 only: `serve --policy vpt` without --vpt-gamma runs +4, not a
    +2 the grid lacks; a grid without any gamma > 0 (no trained prompts) refuses vpt by name."""
    from jaxserve.sched.base import CostModel
    from jaxserve.sched.otas import make_otas_policy

    cost = CostModel(latency={"vit": LAT})
    no_two = ShapeGrid(batch_sizes=(1, 4, 8), gammas=(-10, -5, 0, 8))
    assert make_otas_policy("vpt", {"vit": _Runtime(ACCP, grid=no_two)}, cost).gamma == 8
    unprompted = ShapeGrid(batch_sizes=(1, 4, 8), gammas=(-10, -5, 0))
    with pytest.raises(ValueError, match=r"--policy vpt needs a gamma > 0"):
        make_otas_policy("vpt", {"vit": _Runtime(ACCP, grid=unprompted)}, cost)


def test_otas_family_are_policies_and_describe_what_they_served():
    from jaxserve.sched.base import Policy, StepSummary

    for p in (otas(), PetSPolicy("vit", LAT, ACCP, GRID)):
        assert isinstance(p, Policy) and p.admits("vit") is None and list(p.metrics()) == []
        p.on_arrival(req(0, 0.0, deadline=5.0), 0.0)
        (batch,) = p.plan(0.0, [0]).batches
        assert p.service_time(batch) is None  # priced by the cost model
        p.on_completion(batch, 0.1, {0: StepSummary(0.7, "cat")})
        assert p.describe_request(0) == {"gamma": batch.cell.gamma, "outcome_type": 1}


def test_a_queued_batch_keeps_its_deadline_and_options_current_across_changes_and_reprices():
    """The per-batch caches a plan reads (earliest deadline, per-gamma utility sums, options)
    equal a fresh computation after every change: requests added (the sums continue in the same
    order, so they are equal to the last bit), withdrawn or evicted (``keep``), and a new pricer
    (a reprice or a reloaded accuracy profile)."""
    from jaxserve.sched.otas import _Pricer, _QueuedBatch, _undominated

    p1 = _Pricer("vit", LAT, ACCP, GRID, GAMMAS)
    rs = [req(i, 0.0, deadline=5.0 - 0.1 * i, utility=0.3 + 0.17 * i, task=("c10", "c100")[i % 2]) for i in range(7)]
    qb = _QueuedBatch(0, rs[0], 0.0)
    assert qb.options(p1) == p1.options(rs[:1]) and qb.deadline == 5.0
    for n in range(2, 6):
        qb.add(rs[n - 1])
        if n % 2:  # the DP's read of options and stage, first after the change
            options, stage = qb.dp_inputs(p1)
            assert options == p1.options(rs[:n]) and stage.useful == tuple(_undominated(options))
        assert qb.options(p1) == p1.options(rs[:n])  # exact: the same floating-point sums
        assert qb.deadline == min(r.deadline for r in rs[:n])
        assert qb.dp_inputs(p1) == (qb.options(p1), qb.undominated(p1))
    qb.keep([rs[0], rs[2], rs[3]])  # rs[1] and rs[4] withdrawn or evicted
    assert qb.dp_inputs(p1)[0] == p1.options([rs[0], rs[2], rs[3]])
    assert qb.options(p1) == p1.options([rs[0], rs[2], rs[3]]) and qb.deadline == rs[3].deadline
    slower = latency_profile(scale={g: 2 * s for g, s in SCALE.items()})
    p2 = _Pricer("vit", slower, ACCP, GRID, GAMMAS)  # a reprice
    assert qb.options(p2) == p2.options(qb.requests)
    assert qb.undominated(p2).useful == tuple(_undominated(p2.options(qb.requests)))  # the DP's stage, kept with them
    assert qb.dp_inputs(p2) == (qb.options(p2), qb.undominated(p2))
    assert [o.seconds for o in qb.options(p2)] == [2 * o.seconds for o in p1.options(qb.requests)]
    flat = accuracy_profile(acc={t: {g: 0.5 for g in accs} for t, accs in ACC.items()})
    p3 = _Pricer("vit", slower, flat, GRID, GAMMAS)  # a reloaded accuracy profile
    qb.add(rs[6])
    assert qb.options(p3) == p3.options(qb.requests)
    assert all(o.utility == pytest.approx(0.5 * sum(r.utility for r in qb.requests)) for o in qb.options(p3))
    assert p3.fastest_seconds(4) == min(p3.seconds(4, g) for g in GAMMAS)


def _brute_first_fit(batches, r, now, batching, cap):
    """Alg. 1 as a scan of every batch in creation order."""
    from jaxserve.sched.otas import _deadline_gap, _utility_ratio

    for qb in batches:
        if (now - qb.opened < batching.delta and len(qb.requests) < cap
                and _deadline_gap(r.deadline, qb.deadline) <= batching.eta
                and _utility_ratio(r.utility, qb.first_utility) >= batching.mu):
            return qb
    return None


def _complete_due(policy, busy: dict, now: float) -> None:
    """Report to ``policy`` every batch in ``busy`` (instance -> (finish, batch)) done by ``now``, in
    finishing order, and free its instance."""
    for inst, (f, b) in sorted(busy.items(), key=lambda x: x[1][0]):
        if f <= now:
            del busy[inst]
            policy.on_completion(b, f)


def _admit(q, shadow: list, r, now: float, batching, cap: int, key: int) -> int:
    """Alg. 1's admission of ``r`` as on_arrival does it, checked against :func:`_brute_first_fit`:
    join the batch first_fit finds, else open batch ``key`` (kept in ``shadow``). Returns the next key."""
    from jaxserve.sched.otas import _QueuedBatch

    qb = q.first_fit(r, now, batching, cap)
    assert qb is _brute_first_fit(shadow, r, now, batching, cap)
    if qb is not None:
        q.join(qb, r)
        return key
    qb = _QueuedBatch(key, r, now)
    q.open(qb)
    shadow.append(qb)
    return key + 1


def _keep_some(q, shadow: list, rng, p: float) -> None:
    """A withdrawal or an eviction: a random batch keeps each request with probability ``p``."""
    qb = rng.choice(shadow)
    q.keep(qb, [r for r in qb.requests if rng.random() < p])
    if not qb.requests:
        shadow.remove(qb)


def _dispatch_one(q, shadow: list, rng) -> None:
    """A dispatch: a random batch leaves the queue."""
    qb = rng.choice(shadow)
    q.remove(qb)
    shadow.remove(qb)


@pytest.mark.parametrize("seed", range(6))
def test_batch_queue_indexes_equal_brute_force_after_random_operations(seed):
    """Every answer of the indexed queue (creation order, depth, EDD order, moments, Alg. 1's
    first fit) equals a scan of all batches, after each of a random sequence of opens, joins,
    keeps (evictions, withdrawals: possibly emptying a batch), removals (dispatches), reprices,
    clock steps (one run also steps the clock back) and batching parameters."""
    from jaxserve.sched.otas import _BatchQueue, _Pricer

    rng = random.Random(seed)
    pricers = [_Pricer("vit", LAT, ACCP, GRID, GAMMAS),
               _Pricer("vit", latency_profile(scale={g: 3 * s for g, s in SCALE.items()}), ACCP, GRID, GAMMAS)]
    pricer = pricers[0]
    q, shadow = _BatchQueue(), []  # shadow: the batches, creation order
    batching = BatchingParams(delta=0.3, epsilon=4, eta=0.2, mu=0.8)
    now, rid, key = 0.0, 0, 0

    def request():
        nonlocal rid
        rid += 1
        d = rng.choice([math.inf, now + rng.choice([0.1, 0.25, 0.5]), now + rng.uniform(0.05, 0.6)])
        return req(rid, now, deadline=d, utility=rng.choice([0.0, 0.01, 0.2, 0.3, 0.35, 1.0]))

    for step in range(1500):
        op = rng.random()
        if op < 0.35:  # an arrival, as on_arrival does it
            key = _admit(q, shadow, request(), now, batching, rng.choice([2, 4]), key)
        elif op < 0.45 and shadow:
            _keep_some(q, shadow, rng, 0.6)
        elif op < 0.55 and shadow:
            _dispatch_one(q, shadow, rng)
        elif op < 0.6:
            pricer = rng.choice(pricers)
        elif op < 0.62:
            batching = BatchingParams(delta=rng.choice([0.1, 0.3, 0.6]), epsilon=4, eta=rng.choice([0.05, 0.2]),
                                      mu=rng.choice([0.5, 0.8]))
        elif op < 0.625 and seed == 0 and step > 700:
            now -= 0.2  # the clock goes back: admission falls back to scanning every batch
        else:
            now += rng.choice([0.0, 0.01, 0.05, 0.2])
        assert list(q) == shadow and len(q) == len(shadow)
        assert q.depth == sum(len(qb.requests) for qb in shadow)
        assert q.edd() == sorted(shadow, key=lambda qb: qb.sort_key())
        if rng.random() < 0.5:
            expected = sorted((qb.deadline - pricer.fastest_seconds(len(qb.requests)), qb.key) for qb in shadow)
            got = q.moments(pricer)
            assert [(m, k) for m, k, _ in got] == expected
            assert all(q.batches[k] is qb for _, k, qb in got)


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_index_holds_exactly_the_queued_young_batches_with_room(seed):
    """Alg. 1's index (first_fit's per-utility lists) under one cap, as the policy runs it: batches
    fill up and leave it, are dispatched or emptied, and come back in their place when a keep
    (withdrawal, eviction) makes room. Every first_fit equals a scan of every batch in creation
    order, and after each step the index holds exactly the queued batches with fewer than cap
    requests that it has not yet found too old, in creation order, each with ``joinable`` set."""
    from jaxserve.sched.otas import _BatchQueue

    rng = random.Random(100 + seed)
    q, shadow = _BatchQueue(), []
    batching = BatchingParams(delta=0.3, epsilon=3, eta=0.25, mu=0.8)
    cap = 3
    now, rid, key = 0.0, 0, 0
    for step in range(3000):
        op = rng.random()
        if op < 0.5:
            rid += 1
            r = req(rid, now, deadline=now + rng.choice([0.1, 0.3, 0.5, rng.uniform(0.05, 0.6)]),
                    utility=rng.choice([0.01, 0.2, 0.3, 1.0]))
            key = _admit(q, shadow, r, now, batching, cap, key)
        elif op < 0.7 and shadow:  # a withdrawal or an eviction: often frees room in a full batch
            _keep_some(q, shadow, rng, 0.7)
        elif op < 0.8 and shadow:
            _dispatch_one(q, shadow, rng)
        else:
            now += rng.choice([0.0, 0.01, 0.05, 0.1])
        indexed = [(k, qb) for group in q._young.values() for k, qb in group]
        for group in q._young.values():
            assert [k for k, _ in group] == sorted(k for k, _ in group)
            assert all(k == qb.key for k, qb in group)
        assert len({id(qb) for _, qb in indexed}) == len(indexed)
        assert {id(qb) for _, qb in indexed} == {id(qb) for qb in shadow if qb.joinable}
        assert all(qb.queued and len(qb.requests) < cap for _, qb in indexed)
        # a queued batch with room is missing only if first_fit found it too old (it stays so)
        assert all(qb.joinable or len(qb.requests) >= cap or not now - qb.opened < batching.delta
                   for qb in shadow)


def test_dp_decisions_from_cached_batch_inputs_equal_a_fresh_solve():
    """The policy solves the DP from each queued batch's cached (pricer, options, stage), dropped when
    its requests change; every decision equals solve_token_dp on options priced afresh from the
    requests, through joins, evictions, withdrawals and a reprice (a new pricer)."""
    from jaxserve.sched.base import CostModel

    checked, shared, shortcut = [], [], []

    class Checked(OTASPolicy):
        def _schedule(self, clock, ordered, slots):
            runs = self.counters["dp_runs"]
            out = super()._schedule(clock, ordered, slots)
            if self.counters["dp_runs"] > runs:
                pricer = self._pricer
                m = self.executors  # the two instances' shared clock (module docstring: Several instances)
                start = clock + self.backlog / m if m > 1 else clock
                fresh = solve_token_dp([qb.deadline for qb in ordered],
                                       [pricer.options(list(qb.requests)) for qb in ordered], start,
                                       self.params.max_labels, executors=m)
                if self.last_solution.all_best:  # the shortcut answered: the same decision, no frontier
                    got = self.last_solution
                    assert (got.gammas, got.utility, got.finish) == (fresh.gammas, fresh.utility, fresh.finish)
                    shortcut.append(len(ordered))
                else:
                    assert fresh == self.last_solution
                checked.append(len(ordered))
                shared.append(m == 2 and self.backlog > 0)
            return out

    p = Checked("vit", LAT, ACCP, GRID, params=OTASParams(initial_stage=0.1, beta=1))
    rng = random.Random(3)
    busy: dict[int, tuple[float, object]] = {}
    for r in bursty_requests(5, n=700):
        now = r.arrival
        _complete_due(p, busy, now)
        p.on_arrival(r, now)
        if rng.random() < 0.05:
            p.withdraw(r.id - rng.randrange(1, 20), now)
        if r.id == 350:
            p.reprice(CostModel(latency={"vit": latency_profile(scale={g: 1.5 * s for g, s in SCALE.items()})}), now)
        idle = [i for i in range(2) if i not in busy]
        for b in p.plan(now, idle).batches:
            busy[b.instance] = (now + p._pricer.seconds(len(b.request_ids), b.cell.gamma), b)
    assert len(checked) > 50 and max(checked) > 3 and sum(shared) > 10
    assert 0 < len(shortcut) < len(checked)  # both the all-best shortcut and the full DP decided


def _brute_evictions(policy, free_at):
    """The hopeless requests as a scan of every batch (creation order) finds them, without acting."""
    out = []
    for qb in policy._queue:
        requests = list(qb.requests)
        while requests:
            t = policy._pricer.fastest_seconds(len(requests))
            if free_at + t < min(r.deadline for r in requests):
                break
            hopeless = [r for r in requests if free_at + t >= r.deadline]
            if not hopeless:
                break
            out += [r.id for r in hopeless]
            requests = [r for r in requests if free_at + t < r.deadline]
    return out


def _brute_wake(policy, now):
    wake = math.inf
    blocked = policy._blocked_until()
    if blocked > now and len(policy._queue):
        wake = blocked
    for qb in policy._queue:
        t = policy._pricer.fastest_seconds(len(qb.requests))
        for r in qb.requests:
            when = r.deadline - t
            if now < when < wake:
                wake = when
    return wake


@pytest.mark.parametrize("make", [lambda: otas(params=OTASParams(initial_stage=0.3)),
                                  lambda: PetSPolicy("vit", LAT, ACCP, GRID),
                                  lambda: INFaaSPolicy(variants(), switch_seconds=0.05, decision_interval=0.2)])
def test_indexed_eviction_and_wake_up_equal_a_scan_of_every_request(make):
    """Under overload on two instances, each plan evicts exactly the requests (and in the order)
    a scan of every queued batch finds hopeless, and wakes exactly when the first remaining one
    becomes hopeless (or a load ends)."""
    p = make()
    latency = {"vit": LAT, **{v.name: v.latency for v in variants()}}
    rng = random.Random(7)
    requests = bursty_requests(3, n=600)
    busy: dict[int, tuple[float, object]] = {}
    seen_evictions = 0
    for r in requests:
        now = r.arrival
        _complete_due(p, busy, now)
        p.on_arrival(r, now)
        idle = [i for i in range(2) if i not in busy]
        ends = list(p._busy_until.values())
        free_at = now if idle or not ends else max(now, min(ends))
        free_at = max(free_at, p._blocked_until())
        expected = _brute_evictions(p, free_at)
        plan = p.plan(now, idle)
        assert list(plan.evict) == expected
        seen_evictions += len(expected)
        assert plan.wake_at == _brute_wake(p, now)
        for b in plan.batches:
            busy[b.instance] = (now + latency[b.model].latency(b.cell) * rng.choice([1.0, 2.5]), b)
    assert seen_evictions > 0


def test_records_beyond_the_limit_leave_oldest_first():
    """record_limit keeps the newest outcomes and gammas, in the order they were recorded."""
    p = PetSPolicy("vit", LAT, ACCP, GRID)
    p.record_limit = 3
    for i in range(10):
        p.on_arrival(req(i, 0.1 * i, deadline=0.1 * i + (5.0 if i % 3 else 1e-6)), 0.1 * i)
        plan = p.plan(0.1 * i, [0])
        for b in plan.batches:
            p.on_completion(b, 0.1 * i + 0.01)
    assert list(p.outcomes) == [7, 8, 9] and list(p.request_gamma) == [5, 7, 8]  # 6 and 9: evicted
    assert p.outcomes[9] == OutcomeType.EVICTED and p.outcomes[8] == OutcomeType.ACCURATE_ON_TIME


def test_pricer_utility_sums_equal_a_plain_sum_per_gamma_to_the_bit():
    """_Pricer.utilities sums accuracy x utility per gamma in request order: the same floats as a
    plain loop (continued from partial sums too), and a task without a profile names the first hole."""
    from jaxserve.sched.otas import _Pricer

    pricer = _Pricer("vit", LAT, ACCP, GRID, GAMMAS)
    rng = random.Random(3)
    rs = [req(i, 0.0, utility=rng.choice([0.1, 0.2, 0.3, 0.01, 1 / 3]), task=rng.choice(["c10", "c100"]))
          for i in range(40)]
    plain = []
    for g in pricer.gammas:
        u = 0.0
        for r in rs:
            u += ACCP.of(r.task, g) * r.utility
        plain.append(u)
    assert [x.hex() for x in pricer.utilities(rs)] == [x.hex() for x in plain]
    head = pricer.utilities(rs[:17])
    assert [x.hex() for x in pricer.utilities(rs, 17, head)] == [x.hex() for x in plain]
    with pytest.raises(KeyError, match="'dogs' at gamma -10"):
        pricer.utilities([rs[0], req(99, 0.0, task="dogs")])


def _reference_token_dp(deadlines, options, start, max_labels=128, executors=1):
    """Alg. 2 as first written (one plain loop over label tuples): what solve_token_dp must equal.
    ``executors``: an executed batch must finish (clock + seconds) before its deadline, and the
    clock moves on by seconds / executors."""
    from jaxserve.sched.otas import DPSolution, _same_utility, _undominated

    stages = [[(0.0, start, -1, -1)]]
    truncated, widest = False, 1
    for deadline, opts in zip(deadlines, options):
        useful = _undominated(opts)
        candidates = []
        for parent, (u, c, _, _) in enumerate(stages[-1]):
            candidates.append((u, c, parent, -1))
            for k, o in useful:
                if c + o.seconds < deadline:
                    candidates.append((u + o.utility, c + o.seconds / executors, parent, k))
        candidates.sort(key=lambda lab: (lab[1], -lab[0]))
        frontier = []
        for lab in candidates:
            if not frontier or (lab[0] > frontier[-1][0] and not _same_utility(lab[0], frontier[-1][0])):
                frontier.append(lab)
        if len(frontier) > max_labels:
            truncated = True
            step = (len(frontier) - 1) / (max_labels - 1)
            frontier = [frontier[round(i * step)] for i in range(max_labels)]
        widest = max(widest, len(frontier))
        stages.append(frontier)
    best = len(stages[-1]) - 1
    gammas, index = [], best
    for b in range(len(deadlines), 0, -1):
        _, _, parent, k = stages[b][index]
        gammas.append(None if k < 0 else options[b - 1][k].gamma)
        index = parent
    return DPSolution(tuple(reversed(gammas)), stages[-1][best][0], stages[-1][best][1], widest, truncated)


def count_calls(monkeypatch, module, keys: dict) -> dict:
    """Wrap each function ``name`` of ``module`` (``keys``: name -> counter key) so that its calls
    are counted in the returned dict, and still made."""
    used = {key: 0 for key in keys.values()}
    for name, key in keys.items():
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _key=key, **k: used.__setitem__(_key, used[_key] + 1)
                            or _real(*a, **k))
    return used


def test_dp_equals_its_plain_transcription_to_the_bit(monkeypatch):
    """solve_token_dp (numpy for large stages, lists for small ones) returns exactly what the plain
    loop returns: the same gammas, utility and finish to the last bit, frontier width and truncation,
    on random queues built to hit the hard cases: equal clocks (dyadic seconds), utilities equal
    up to rounding (sums of 0.1, 0.2, 0.3 in different orders), and thinned frontiers. (With the
    native DP off: tests/unit/test_otas_native_dp.py compares it with these stages and this loop.)"""
    import jaxserve.sched.otas as otas_module

    monkeypatch.setenv("JAXSERVE_NATIVE_DP", "0")
    used = count_calls(monkeypatch, otas_module, {"_dp_stage_complex": "numpy", "_dp_keep_near_ties": "near",
                                                   "_dp_stage_python": "python"})
    rng = random.Random(11)
    for trial in range(60):
        n = rng.randint(1, 40)
        dyadic = trial % 2 == 0
        options, deadlines, clock = [], [], 0.0
        for _ in range(n):
            opts = []
            for g in rng.sample(range(-4, 9), rng.randint(1, 6)):
                seconds = rng.choice([0.125, 0.25, 0.375, 0.5]) if dyadic else rng.uniform(0.01, 0.3)
                utility = rng.choice([0.1, 0.2, 0.3, 0.7]) * rng.choice([1, 1, 2, 3]) if trial % 3 else rng.uniform(0, 2)
                opts.append(GammaOption(g, seconds, utility))
            clock += rng.uniform(0.05, 0.3)
            options.append(opts)
            deadlines.append(rng.choice([clock, clock * 2, math.inf]))
        for max_labels in (2, 7, 64, 128):
            got = solve_token_dp(deadlines, options, 0.0, max_labels)
            want = _reference_token_dp(deadlines, options, 0.0, max_labels)
            assert got.gammas == want.gammas
            assert got.utility.hex() == want.utility.hex() and got.finish.hex() == want.finish.hex()
            assert (got.max_frontier, got.truncated) == (want.max_frontier, want.truncated)
    assert min(used.values()) > 0, used  # every path ran


def _random_stage(rng, kind):
    """A frontier (clocks, negated utilities), undominated options and a deadline for one DP stage,
    drawn for the hard cases: equal clocks, utilities equal up to rounding, large magnitudes."""
    from jaxserve.sched.otas import _undominated

    n = rng.choice([1, 2, 5, 40, 90, 127, 128, 200])
    if kind == "frontier":  # as a stage leaves it: clocks and utilities ascending
        clocks = sorted(rng.choice([0.125, 0.25, 0.5, 0.375]) * rng.randint(0, 60) for _ in range(n)) \
            if rng.random() < 0.5 else sorted(rng.uniform(0.0, 3.0) for _ in range(n))
        negs = sorted((-sum(rng.choice([0.1, 0.2, 0.3]) for _ in range(rng.randint(0, 12))) for _ in range(n)),
                      reverse=True)
    else:  # anything (the stage does not rely on the order)
        clocks = [rng.choice([0.25 * rng.randint(0, 9), rng.uniform(-1.0, 3.0), -0.0]) for _ in range(n)]
        negs = [rng.choice([-0.1 - 0.2, -0.3, -0.0, 0.0, -rng.uniform(0, 1e12), rng.uniform(-5, 5)]) for _ in range(n)]
    if kind == "infinite":  # an infinite start: every clock infinite (still no NaN)
        clocks = [rng.choice([math.inf, -math.inf])] * n
    opts = [GammaOption(g, rng.choice([0.125, 0.25, 0.5, rng.uniform(0.01, 0.6)]),
                        rng.choice([0.1, 0.2, 0.3, 0.1 + 0.2, 0.0, rng.uniform(0, 2), 3e11]))
            for g in rng.sample(range(-4, 9), rng.randint(1, 6))]
    high = max(clocks) if clocks else 0.0
    deadline = rng.choice([math.inf, high, high / 2, min(clocks) - 1.0, min(clocks) + 0.3, 0.0])
    return clocks, negs, _undominated(opts), deadline


def test_dp_complex_stage_equals_the_two_array_stage_to_the_bit(monkeypatch):
    """_dp_stage_complex (the frontier as one complex array, one stable sort, a pre-check before the
    near-tie test) makes the labels _dp_stage_numpy makes: the same clocks and utilities to the bit,
    the same parents and options, the same thinning, on frontiers with equal clocks, utilities equal
    up to rounding, large magnitudes, signed zeros, infinite clocks and every kind of deadline."""
    import numpy as np

    import jaxserve.sched.otas as otas_module
    from jaxserve.sched.otas import _dp_stage_complex, _dp_stage_numpy, _DPStage

    near = {"n": 0}
    real = otas_module._dp_keep_near_ties
    monkeypatch.setattr(otas_module, "_dp_keep_near_ties", lambda *a: near.__setitem__("n", near["n"] + 1) or real(*a))
    rng = random.Random(5)
    thinned = 0
    for trial in range(600):
        clocks, negs, useful, deadline = _random_stage(rng, ("frontier", "any", "infinite")[trial % 3])
        stage = _DPStage(useful)
        assert stage.plain and stage.useful == tuple(useful)
        joint = np.empty(len(clocks), dtype=np.complex128)
        joint.real, joint.imag = clocks, negs
        for max_labels in (2, 7, 128):
            got, link, got_thinned = _dp_stage_complex(joint.copy(), stage, deadline, max_labels)
            want_c, want_n, want_link, want_thinned = _dp_stage_numpy(clocks, negs, useful, deadline, max_labels)
            assert [x.hex() for x in got.real.tolist()] == [x.hex() for x in want_c.tolist()]
            assert [x.hex() for x in got.imag.tolist()] == [x.hex() for x in want_n.tolist()]
            assert link[0] == want_link[0] == "np" and link[2:] == want_link[2:]
            assert link[1].tolist() == want_link[1].tolist()
            assert got_thinned == want_thinned
            thinned += got_thinned
    assert near["n"] > 20 and thinned > 100  # the near-tie test and the thinning really ran


def _old_rule_token_dp(deadlines, options, start, max_labels=128):
    """solve_token_dp before the complex stage: lists below 160 candidates, two arrays from there."""
    import numpy as np

    from jaxserve.sched.otas import DPSolution, _dp_parent, _dp_stage_numpy, _dp_stage_python, _undominated

    clocks, negs, links, truncated, widest = [start], [-0.0], [], False, 1
    for deadline, opts in zip(deadlines, options):
        useful = _undominated(opts)
        if len(clocks) * (len(useful) + 1) >= 160:
            clocks, negs, link, thinned = _dp_stage_numpy(clocks, negs, useful, deadline, max_labels)
        else:
            if isinstance(clocks, np.ndarray):
                clocks, negs = clocks.tolist(), negs.tolist()
            clocks, negs, link, thinned = _dp_stage_python(clocks, negs, useful, deadline, max_labels)
        truncated, widest = truncated or thinned, max(widest, len(clocks))
        links.append(link)
    best = len(clocks) - 1
    gammas, index = [], best
    for b in range(len(deadlines) - 1, -1, -1):
        index, k = _dp_parent(links[b], index)
        gammas.append(None if k < 0 else options[b][k].gamma)
    return DPSolution(tuple(reversed(gammas)), -float(negs[best]), float(clocks[best]), widest, truncated)


def test_dp_once_a_nan_may_arise_runs_each_stage_where_it_always_did(monkeypatch):
    """A NaN among the options (or an infinite one, whence inf - inf) may sort differently in the
    complex stage, so from that batch on solve_token_dp runs every stage where it ran before the
    complex stage existed; before it, the complex stage (the same labels)."""
    import jaxserve.sched.otas as otas_module

    used = count_calls(monkeypatch, otas_module, {"_dp_stage_complex": "complex", "_dp_stage_numpy": "two"})
    rng = random.Random(3)
    for trial in range(30):
        n = rng.randint(20, 40)
        options = [[GammaOption(g, rng.choice([0.125, 0.25, 0.5]), rng.choice([0.1, 0.2, 0.3]) * rng.randint(1, 3))
                    for g in rng.sample(range(-4, 9), rng.randint(2, 5))] for _ in range(n)]
        bad = rng.randrange(n)
        bad_value = rng.choice([math.nan, math.inf, -math.inf])
        options[bad][0] = GammaOption(options[bad][0].gamma, options[bad][0].seconds if trial % 2 else bad_value,
                                      bad_value if trial % 2 else options[bad][0].utility)
        deadlines = [rng.choice([math.inf, 0.5 * (b + 1)]) for b in range(n)]
        for start in (0.0, math.nan) if trial < 3 else (0.0,):
            got = solve_token_dp(deadlines, options, start)
            want = _old_rule_token_dp(deadlines, options, start)
            assert got.gammas == want.gammas
            assert got.utility.hex() == want.utility.hex() and got.finish.hex() == want.finish.hex()
            assert (got.max_frontier, got.truncated) == (want.max_frontier, want.truncated)
    assert used["complex"] > 0 and used["two"] > 0
