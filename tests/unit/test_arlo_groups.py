"""Arlo's runtime groups (jaxserve/sched/arlo/groups.py) and the issue-24 regression: few instances,
short real texts.

The regression runs in the simulator on this machine's MiniLM-L6 profile of the serve grid
(tests/fixtures/minilm-l6-serve-cost.json, a copy of bench/results/sim_knee-cost_model.json of 11-23) and
real tweet lengths.
"""

from __future__ import annotations

import itertools


import numpy as np
import pytest

from conftest import FIXTURES
from jaxserve import traces
from jaxserve.sched.arlo import ArloPolicy
from jaxserve.sched.arlo.groups import GroupCostModel, grouping_objective, groups_of, profile_max_batch, solve_groups
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, Request, ShapeGrid, bucket_for_length
from jaxserve.simulator import LATE, OK, simulate

SERVE_COST = FIXTURES / "minilm-l6-serve-cost.json"
MODEL = "minilm-l6"

BUCKETS = (16, 32, 64, 128)
GRID = ShapeGrid(batch_sizes=(1, 2, 4, 8), seq_buckets=BUCKETS)
PROFILE = LatencyProfile("bert", {Cell(b, s): 0.002 + 0.001 * b * (1 + s / 32) for s in BUCKETS
                                  for b in GRID.batch_sizes})


def model(slo=0.2):
    mb = [profile_max_batch(PROFILE, GRID.batch_sizes, s, slo) for s in BUCKETS]
    return GroupCostModel(PROFILE, BUCKETS, GRID.batch_sizes, mb, slo)


def test_profile_max_batch_is_the_largest_batch_within_half_the_slo():
    # t(b, 128) = 0.002 + 0.005 b: b=4 takes 22 ms, b=8 42 ms
    assert profile_max_batch(PROFILE, GRID.batch_sizes, 128, 0.05) == 4
    assert profile_max_batch(PROFILE, GRID.batch_sizes, 128, 0.1) == 8
    assert profile_max_batch(PROFILE, GRID.batch_sizes, 128, 0.001) == 1  # too slow even alone: 1


@pytest.mark.parametrize("instances,rates", [(3, (100, 50, 20, 5)), (4, (0, 300, 0, 40)), (5, (400, 400, 100, 80)),
                                             (2, (0, 0, 0, 0))])
def test_solve_groups_is_the_exact_optimum_over_contiguous_groups(instances, rates):
    m = model()
    best = solve_groups(m, rates, instances)
    assert sum(best.counts) == instances and best.counts[-1] >= 1  # Eq. 2 and Eq. 7
    assert groups_of(best.counts) == best.groups
    brute = min(grouping_objective(m, rates, c)
                for c in itertools.product(range(instances + 1), repeat=len(BUCKETS))
                if sum(c) == instances and c[-1] >= 1)
    assert best.objective == pytest.approx(brute, rel=1e-9)
    assert grouping_objective(m, rates, best.counts) == pytest.approx(best.objective, rel=1e-9)


def test_pooling_wins_when_the_instances_keep_up():
    """Every instance holds every executable, so a group costs nothing but the waiting it saves:
    while the instances keep up (here, and in 35 of the 36 cells of bench/arlo_short.py's matrix)
    the estimate prefers one group of every runtime."""
    m = model()
    assert solve_groups(m, (20, 20, 20, 20), 8).groups == ((0, 3),)
    assert solve_groups(m, (1500, 0, 0, 180), 16).groups == ((0, 3),)


def test_first_period_is_one_group_and_a_group_batch_runs_in_its_requests_own_bucket():
    policy = ArloPolicy("bert", GRID, PROFILE, 0.2, 2)
    assert policy.instances_per_runtime() == {16: 0, 32: 0, 64: 0, 128: 2}
    for i, n in enumerate((10, 10, 30, 100, 12)):
        policy.on_arrival(Request(i, 0.001 * i, "bert", length=n), 0.001 * i)
    plan = policy.plan(0.01, [0, 1])
    cells = sorted(((b.cell, b.request_ids) for b in plan.batches), key=lambda x: x[0].seq)
    # the oldest head (bucket 16) runs with its bucket-mates, wherever they arrived; the other
    # instance takes the next oldest head (30 tokens: bucket 32), nothing shorter is left to merge
    assert cells == [(Cell(4, 16), (0, 1, 4)), (Cell(1, 32), (2,))]
    assert policy.counters.demotions == 0


def test_a_padded_row_is_filled_with_a_shorter_request():
    policy = ArloPolicy("bert", GRID, PROFILE, 0.2, 1)
    for i, n in enumerate((100, 110, 120, 20)):  # three of bucket 128 (batch 4 cell: one spare row)
        policy.on_arrival(Request(i, 0.001 * i, "bert", length=n), 0.001 * i)
    (batch,) = policy.plan(0.01, [0]).batches
    assert batch.cell == Cell(4, 128) and sorted(batch.request_ids) == [0, 1, 2, 3]


def test_paper_deployment_is_still_there():
    policy = ArloPolicy("bert", GRID, PROFILE, 0.2, 2, shared_runtimes=False, max_batch=1)
    assert policy.instances_per_runtime() == {16: 0, 32: 0, 64: 1, 128: 1}  # even split (remainder longest)
    policy.on_arrival(Request(0, 0.0, "bert", length=10), 0.0)
    (batch,) = policy.plan(0.0, [0, 1]).batches
    assert batch.cell == Cell(1, 64)  # padded to its instance's runtime


# ------------------------------------------------------------------ issue 24 regression


def _real_length_trace(instances: int, load: float, seconds: float, seed: int):
    from jaxserve.datasets import tweet_token_lengths

    cost = CostModel.from_json(SERVE_COST.read_text())
    prof = cost.latency[MODEL]
    cells = prof.cells()
    grid = ShapeGrid(tuple(sorted({c.batch for c in cells})), tuple(sorted({c.seq for c in cells})))
    pool = np.minimum(tweet_token_lengths().astype(np.int64), grid.max_length)
    # load = a fraction of what `instances` serve one request at a time in its own bucket
    per = np.mean([prof.latency_for(1, bucket_for_length(int(n), grid.seq_buckets)) for n in pool])
    rate = load * instances / per
    mean = (0.5 * 2.0 + 2.5 * 0.5) / 2.5  # jaxserve simulate's MMPP, normalised to the nominal rate
    arr = traces.mmpp_arrivals((rate * 0.5 / mean, rate * 2.5 / mean), (2.0, 0.5), duration=seconds, seed=seed)
    tr = traces.make_trace(arr, model=MODEL, length=traces.sample_lengths(pool, len(arr), seed=seed + 1), slo_s=0.5)
    return tr, cost, grid


def test_arlo_at_two_instances_and_30_percent_load_on_real_tweets_is_on_time_and_barely_padded():
    """Issue 24: 2 instances (the serve default), real unstretched tweet lengths, bursty arrivals at
    30 % load, SLO 500 ms. Arlo as `--policy arlo` builds it answers nothing late and pads little;
    on the same trace the paper's deployment (one runtime per instance, batch 1, even start) does
    not -- the test can fail."""
    tr, cost, grid = _real_length_trace(2, 0.30, 30.0, seed=1)
    assert len(tr) > 1500
    arlo = simulate(ArloPolicy(MODEL, grid, cost, 0.5, 2), tr, cost, 2)
    assert int((arlo.outcome == LATE).sum()) == 0 and bool(np.all(arlo.outcome == OK))
    assert arlo.padding_ratio() <= 1.3
    paper = simulate(ArloPolicy(MODEL, grid, cost, 0.5, 2, shared_runtimes=False, max_batch=1), tr, cost, 2)
    assert int((paper.outcome == LATE).sum()) > 0 and paper.padding_ratio() > 1.3
