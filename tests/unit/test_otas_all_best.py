"""The shortcuts that keep OTAS's plans cheap at 100+ instances, each against what it replaces:

* :func:`~jaxserve.sched.otas._all_best_solution` (Alg. 2's answer where every batch's most useful
  option fits) against :func:`~jaxserve.sched.otas.solve_token_dp`, to the bit, on the DP's hard
  random cases, and whole simulations with and without it;
* :func:`~jaxserve.sched.otas._undominated` (one sort) against the pairwise definition;
* the policy's running backlog (``_Ahead``) against summing every busy estimate.

Pure Python on hand-made or shipped profiles; seeded, no wall clock.
"""

from __future__ import annotations

import math
import random
from decimal import Decimal

import numpy as np
import pytest

from test_otas_behaviour import profile, workload
from test_otas_native_dp import KINDS, _bits, _random_dp
from jaxserve import traces
from jaxserve.sched.otas import (
    GammaOption,
    OTASParams,
    OTASPolicy,
    _Ahead,
    _all_best_solution,
    _DPStage,
    _undominated,
    _undominated_pairs,
    solve_token_dp,
)
from jaxserve.simulator import simulate
from bench.otas_utility import MODEL


def _loose(rng: random.Random, kind: str):
    """A queue of ``_random_dp``'s kind whose deadlines mostly let every batch run at its most
    useful option (so the shortcut has something to answer), some cut just at that option's end."""
    deadlines, options, start = _random_dp(rng, kind)
    clock, out = start, []
    for d, opts in zip(deadlines, options):
        best = max(opts, key=lambda o: o.utility)
        end = clock + best.seconds
        out.append(rng.choice([math.inf, end + 1.0, end * 2 + 1.0, end, math.nextafter(end, math.inf), d]))
        clock = clock + best.seconds
    return out, options, start


def test_the_shortcut_answers_as_the_dp_does_to_the_bit():
    """On thousands of random queues (every hard kind of the native DP's tests: equal clocks, exact
    and near ties, zeros, huge and rounding magnitudes, negative steps; loose and cut deadlines),
    wherever the shortcut answers, the full DP at any cap gives the same gammas, utility and finish
    to the bit; and the shortcut's answer is independently what it claims: every batch at its most
    useful option, each meeting its deadline on the shared clock."""
    rng = random.Random(11)
    answered = declined_feasible = 0
    per_kind = dict.fromkeys(KINDS, 0)
    for trial in range(4000):
        kind = KINDS[trial % len(KINDS)]
        deadlines, options, start = (_loose if trial % 3 else _random_dp)(rng, kind)
        executors = rng.choice([1, 1, 2, 3, 7, 100])
        stages = [_DPStage(_undominated(o)) for o in options]
        got = _all_best_solution(deadlines, stages, start, executors)
        if got is None:
            declined_feasible += bool(options) and all(s.best is not None for s in stages)
            continue
        answered += 1
        per_kind[kind] += 1
        assert got.all_best and got.max_frontier == 1 and not got.truncated
        for max_labels in (2, 7, 128):
            full = solve_token_dp(deadlines, options, start, max_labels, executors=executors)
            assert got.gammas == full.gammas, (kind, max_labels)
            assert _bits(got.utility) == _bits(full.utility) and _bits(got.finish) == _bits(full.finish)
        clock = start
        for d, opts, g in zip(deadlines, options, got.gammas):
            chosen = next(o for o in opts if o.gamma == g)
            assert chosen.utility == max(o.utility for o in opts)
            assert clock + chosen.seconds < d
            clock += chosen.seconds / executors
    assert answered > 1000 and declined_feasible > 500
    assert all(n > 20 for n in per_kind.values()), per_kind


def test_a_near_tie_and_a_deadline_it_would_miss_go_to_the_dp():
    """Worked by hand. Two options 0.1 s / utility 1.0 and 0.2 s / 1.0 + 1e-10: the DP counts the
    second no better (within 1e-9) and keeps the earlier clock, gamma 0; taking the most useful
    would pick gamma 4, so the shortcut must leave it to the DP. With a clear lead (1.5) it answers
    gamma 4, unless the deadline falls at the end of that option (0.2 is not < 0.2)."""
    near = [GammaOption(0, 0.1, 1.0), GammaOption(4, 0.2, 1.0 + 1e-10)]
    assert solve_token_dp([1.0], [near], 0.0).gammas == (0,)
    assert _all_best_solution([1.0], [_DPStage(_undominated(near))], 0.0) is None
    clear = [GammaOption(0, 0.1, 1.0), GammaOption(4, 0.2, 1.5)]
    stage = [_DPStage(_undominated(clear))]
    assert _all_best_solution([1.0], stage, 0.0).gammas == (4,)
    assert _all_best_solution([0.2], stage, 0.0) is None
    assert solve_token_dp([0.2], [clear], 0.0).gammas == (0,)
    # a batch whose every option earns nothing: skip is as good, the DP decides
    zero = [GammaOption(0, 0.1, 0.0)]
    assert _all_best_solution([1.0], [_DPStage(_undominated(zero))], 0.0) is None


def _run(trace, instances: int, shortcut: bool):
    cost, grid = profile()
    policy = OTASPolicy(MODEL, cost.latency[MODEL], cost.accuracy[MODEL], grid,
                        params=OTASParams(all_best_shortcut=shortcut), start_time=-2.0)
    return simulate(policy, trace, cost, instances=instances), policy


@pytest.mark.parametrize("instances", [1, 8])
def test_a_simulation_with_the_shortcut_equals_one_without(instances):
    """The demo ViT's shipped profile, Table II's query types, arrivals alternating a tenth and
    twice what the fleet serves at gamma 0: with and without the shortcut every decision, start,
    finish and outcome is the same, while the shortcut answered some plans and the full DP the
    others (the overload half)."""
    capacity = 580.0 * instances
    arrivals = traces.mmpp_arrivals((0.1 * capacity, 2.0 * capacity), (0.5, 0.5), duration=3.0, seed=instances)
    trace = workload(arrivals, seed=200 + instances)
    (on, with_it), (off, without) = _run(trace, instances, True), _run(trace, instances, False)
    for field in ("start", "finish", "outcome", "batch", "cell_batch", "cell_gamma", "batch_instance"):
        assert np.array_equal(getattr(on, field), getattr(off, field), equal_nan=True), field
    assert with_it.decisions == without.decisions
    assert with_it.expected_utility == without.expected_utility
    assert with_it.counters["dp_runs"] == without.counters["dp_runs"] > 0
    assert without.counters["dp_all_best"] == 0
    assert 0 < with_it.counters["dp_all_best"] < with_it.counters["dp_runs"], with_it.counters
    assert len(set(on.cell_gamma[on.completed()].tolist())) > 1  # it adapted, so the DP had choices to make


def test_undominated_by_one_sort_equals_every_pair():
    """Random option lists with exact ties, signed zeros, infinities, ints, Decimals and NaNs: the
    same options kept, in the same order, as the pairwise definition."""
    rng = random.Random(5)
    values = [0.0, -0.0, 1.0, 0.5, 2.0, math.inf, -math.inf, 0.1, 0.2, 0.1 + 0.2, 0.3, 1, Decimal("0.5")]
    compared = 0
    for _ in range(20000):
        n = rng.randint(0, 9)
        options = [GammaOption(rng.randint(-3, 3), rng.choice(values) if rng.random() < 0.6 else rng.random(),
                               rng.choice(values) if rng.random() < 0.6 else rng.random()) for _ in range(n)]
        if n and rng.random() < 0.05:
            options[rng.randrange(n)] = rng.choice([GammaOption(0, math.nan, 1.0), GammaOption(0, 1.0, math.nan)])
        try:
            want = _undominated_pairs(options)
        except ArithmeticError:  # a Decimal compared with a NaN: no definition to compare with
            continue
        got = _undominated(options)
        assert [(i, id(o)) for i, o in got] == [(i, id(o)) for i, o in want], options
        compared += 1
    assert compared > 19000


def test_the_running_backlog_equals_summing_every_estimate():
    """Random dispatches, completions and re-dispatches on 50 instances with a clock that only moves
    on: the running backlog equals the sum of (finish - now) over the estimates after now (up to
    rounding), is exactly 0 with none, and declines to answer for a clock that went back."""
    rng = random.Random(9)
    ahead, busy, now = _Ahead(), {}, 0.0
    checked = 0
    for _ in range(20000):
        op = rng.random()
        instance = rng.randrange(50)
        if op < 0.45:
            busy[instance] = now + rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.01)])
            ahead.set(instance, busy[instance])
        elif op < 0.8:
            busy.pop(instance, None)
            ahead.drop(instance)
        else:
            now += rng.choice([0.0, rng.uniform(0.0, 0.05)])
            want = sum(f - now for f in busy.values() if f > now)
            got = ahead.backlog(now)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
            if want == 0.0:
                assert got == 0.0
            checked += 1
    assert checked > 3000
    assert ahead.backlog(now - 1.0) is None
