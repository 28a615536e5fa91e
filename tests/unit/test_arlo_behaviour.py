"""Arlo's claimed behaviours, in the simulator on small synthetic profiles (issue 22).

Each test reproduces a situation the paper describes (Tan et al., ICPP '24) with the paper's
deployment (``shared_runtimes=False``: one runtime per instance, batch 1, §3.3 and §5) and
checks the behaviour it claims, with the expected outcome worked by hand in the docstring.
No wall clock: simulated latencies, fixed traces.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import traces
from jaxserve.sched.arlo import ArloPolicy
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid
from jaxserve.simulator import OK, simulate

# -- §3.2 Fig. 4 / §5.2.3: the Request Scheduler against ILB and IG ----------------------------

FIG4_BUCKETS = (128, 256, 512)
FIG4_GRID = ShapeGrid(batch_sizes=(1,), seq_buckets=FIG4_BUCKETS)
# batch 1, a staircase as in Fig. 2: 12, 20 and 34 ms
FIG4_COST = CostModel({"bert": LatencyProfile("bert", {Cell(1, 128): 0.012, Cell(1, 256): 0.020,
                                                      Cell(1, 512): 0.034})})
FIG4_SLO = 0.48  # M = floor(SLO / t): 40 on a 128 instance, 24 on the 256 one, 14 on the 512 one


def fig4_trace(short: int = 84, long: int = 14) -> traces.Trace:
    """Fig. 4 scaled up: a burst of ``short`` 100-token requests within 10 ms, then ``long``
    requests of 300-512 tokens (only the 512 runtime fits them) within 10 ms from t = 20 ms."""
    arrival = np.concatenate([np.linspace(0.0, 0.010, short), 0.020 + np.linspace(0.0, 0.010, long)])
    length = np.concatenate([np.full(short, 100), np.linspace(300, 512, long).astype(np.int64)])
    return traces.make_trace(arrival, model="bert", length=length, slo_s=FIG4_SLO)


def fig4_run(dispatcher: str):
    """Fig. 4's cluster: two instances of the 128 runtime, one of 256, one of 512; no
    reallocation during the 0.5 s the trace lasts (the first solve would come after 10 s)."""
    policy = ArloPolicy("bert", FIG4_GRID, FIG4_COST, FIG4_SLO, 4, dispatcher=dispatcher, shared_runtimes=False,
                        max_batch=1, initial_allocation=(2, 1, 1), period=60.0)
    result = simulate(policy, fig4_trace(), FIG4_COST, 4)
    assert policy.counters.reallocations == 0 and result.outcome_counts()["ok"] + result.outcome_counts()[
        "late"] == len(result)
    return policy, result


def test_request_scheduler_beats_ilb_and_ig_on_the_fig4_burst():
    """§3.2 (Fig. 4) and §5.2.3 (Table 4: RS lowers both the mean and the p98 against ILB and IG).

    84 short requests arrive while the two 128 instances can take 2 * 40 = 80 within the SLO,
    then 14 long ones, which only the 512 instance fits (14 * 34 ms = 476 ms: exactly its SLO
    capacity if nothing else runs there). By hand:

    * ILB (least padding) queues 42 on each 128 instance: the last ones finish at 41-42 * 12 ms
      = 492-504 ms > 480 ms, so about 4 short requests are late ("five initial requests cannot
      meet the SLO"); mean about (84 * 258 + 14 * 255) / 98 = 258 ms less the arrival spread.
    * IG (least congested among all candidates) spreads the burst by load / M over all four
      instances, about 10 short requests on the 512 instance (10 / 14 ~ 71 % ~ 28 / 40): the long
      requests then queue behind 340 ms of short ones and about 10 of them are late ("it
      makes eight latecomers fail"), the last of them finishing near 340 + 476 = 816 ms.
    * Alg. 1 fills the 128 instances to 85 % of M (34 each), demotes the rest (16) to the 256
      instance (threshold 0.85 * 0.9 * 24 = 18.4, 16 * 20 = 320 ms) and leaves the 512 instance
      to the long requests ("scheduling 5 of the first eight to GPU2, no SLO violation"): no
      request late, mean about (68 * 210 + 16 * 170 + 14 * 255) / 98 = 210 ms, p98 < 480 ms.
    """
    arlo_policy, arlo = fig4_run("arlo")
    _, ilb = fig4_run("ilb")
    _, ig = fig4_run("ig")
    assert arlo.mean_latency() < 0.9 * min(ilb.mean_latency(), ig.mean_latency())
    assert arlo.p98() < 0.9 * min(ilb.p98(), ig.p98())
    # the mechanism, as Fig. 4 tells it
    short = arlo.length <= 128
    assert (arlo.outcome == OK).all()  # Arlo: nobody late
    assert set(arlo.cell_seq[short]) == {128, 256} and set(arlo.cell_seq[~short]) == {512}
    assert arlo_policy.counters.demotions == int((arlo.cell_seq[short] == 256).sum()) > 0
    assert (ilb.outcome[short] != OK).sum() >= 3 and (ilb.outcome[~short] == OK).all()  # ILB: shorts late
    assert (ig.outcome[~short] != OK).sum() >= 5 and (ig.outcome[short] == OK).all()  # IG: longs late


# -- §3.3: the Runtime Scheduler follows the length distribution -----------------------------

SHIFT_BUCKETS = (64, 128, 192, 256)
SHIFT_GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=SHIFT_BUCKETS)
# 1 ms + 10 us per token per row, profiled at every 32 tokens (as in test_arlo_baselines)
SHIFT_PROFILE = LatencyProfile("bert", {Cell(b, s): b * (0.001 + 1e-5 * s) for b in (1, 2, 4)
                                        for s in range(32, 257, 32)})
SHIFT_COST = CostModel({"bert": SHIFT_PROFILE})
SHIFT_SLO = 0.1
SHIFT_AT = 2.0  # seconds of short requests, then as long of long ones


def shift_trace(until: float) -> traces.Trace:
    """2000 requests/s (Poisson); lengths 1-64 before :data:`SHIFT_AT`, 193-256 after; the
    requests that arrive before ``until``."""
    arrival = traces.poisson_arrivals(2000.0, duration=2 * SHIFT_AT, seed=0)
    rng = np.random.default_rng(1)
    length = np.where(arrival < SHIFT_AT, rng.integers(1, 65, len(arrival)), rng.integers(193, 257, len(arrival)))
    keep = arrival < until
    return traces.make_trace(arrival[keep], model="bert", length=length[keep], slo_s=SHIFT_SLO)


def shift_policy(period: float = 0.5) -> ArloPolicy:
    return ArloPolicy("bert", SHIFT_GRID, SHIFT_COST, SHIFT_SLO, 10, shared_runtimes=False, max_batch=1,
                      period=period, window=period, warmup=period)


@pytest.mark.parametrize("until", [SHIFT_AT, 2 * SHIFT_AT])
def test_runtime_scheduler_moves_instances_to_the_runtime_of_the_new_lengths(until):
    """§3.3: the allocation follows the length distribution, solve by solve (every 0.5 s over
    the last 0.5 s). Two runs of the same trace, cut at the shift and at its end (the policy
    is causal, so the first is the second's state at the shift, plus the drain of its queues).

    By hand (Eq. 1-7): 2000 requests/s is Q = 200 per 100 ms SLO. Before the shift every
    request is in the 64 bin: M_64 = floor(100 / 1.64) = 60, so Eq. 3 wants N_64 >=
    floor(200 / 60) = 3, Eq. 7 wants N_256 >= 1, and every other instance also goes to the 64
    runtime, since it is the only one with demand and there an instance lowers the cost
    C^2 * t / N: (9, 0, 0, 1). After the shift every request is in the 256 bin: M_256 =
    floor(100 / 3.56) = 28, Eq. 3 wants N_256 >= floor(200 / 28) = 7 and for the same reason all go
    there: (0, 0, 0, 10). It starts even, (2, 2, 3, 3) (remainder to the longest runtimes).
    Long requests need 2000 * 3.56 ms = 7.1 instances of the 256 runtime: the one left there
    before the shift falls behind until the next solve, and once the 10 have drained that
    backlog (ten instances drain ~800 requests of excess per second) the last half second is
    on time again.
    """
    policy = shift_policy()
    assert policy.instances_per_runtime() == {64: 2, 128: 2, 192: 3, 256: 3}
    result = simulate(policy, shift_trace(until), SHIFT_COST, 10)
    assert policy.counters.served == len(result)
    if until == SHIFT_AT:  # after the solves of the short phase: on the short runtime
        assert policy.instances_per_runtime() == {64: 9, 128: 0, 192: 0, 256: 1}
        assert policy.counters.allocation_changes == 1
    else:  # after the solves that followed the shift: on the long runtime
        assert policy.instances_per_runtime() == {64: 0, 128: 0, 192: 0, 256: 10}
        assert policy.counters.allocation_changes == 2
        assert (result.outcome[result.arrival >= 2 * SHIFT_AT - 0.5] == OK).all()


def test_without_runtime_scheduler_solves_the_allocation_stays_even():
    """The control for the test above: with no solve in the trace (a period longer than it),
    the instances stay where they started, whatever the lengths, and the 3 instances of the
    256 runtime cannot keep up with the long requests (7.1 needed): the last ones are late."""
    policy = shift_policy(period=10.0)
    result = simulate(policy, shift_trace(2 * SHIFT_AT), SHIFT_COST, 10)
    assert (result.outcome[result.arrival >= 2 * SHIFT_AT - 0.5] != OK).all()
    assert policy.counters.reallocations == 0
    assert policy.instances_per_runtime() == {64: 2, 128: 2, 192: 3, 256: 3}
