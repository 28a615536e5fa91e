"""The engine's running price correction (jaxserve.cost_drift) and a policy's repricing."""

import math

import pytest

from jaxserve.cost_drift import CostDrift
from jaxserve.sched.base import AccuracyProfile, Cell, CostModel, LatencyProfile, Request, ShapeGrid
from jaxserve.sched.batching import DeadlineBatching

A, B = Cell(1, 16), Cell(4, 16)


def cost(a=0.010, b=0.020):
    return CostModel({"m": LatencyProfile("m", {A: a, B: b})},
                     accuracy={"m": AccuracyProfile("m", {("t", 0): 0.9})}, machine="here")


def test_no_correction_before_min_samples_then_the_measured_ratio():
    d = CostDrift(cost(), min_samples=8)
    for _ in range(7):
        d.observe("m", A, 0.020)
    assert d.ratio("m", A) == 1.0 and d.ratio("m", B) == 1.0  # 7 steps: the profile stands
    d.observe("m", A, 0.020)
    assert d.ratio("m", A) == pytest.approx(2.0)
    assert d.ratio("m", B) == pytest.approx(2.0)  # unmeasured cell: its model's ratio
    assert d.samples("m", A) == 8 and d.samples("m", B) == 0


def test_a_measured_cell_keeps_its_own_ratio_and_the_model_mean_is_in_log_space():
    d = CostDrift(cost(), min_samples=2)
    for _ in range(4):
        d.observe("m", A, 0.040)  # 4x
        d.observe("m", B, 0.010)  # 0.5x
    assert d.ratio("m", A) == pytest.approx(4.0)
    assert d.ratio("m", B) == pytest.approx(0.5)
    # geometric mean of 4 and 0.5 over 8 equally weighted steps: sqrt(2), not the arithmetic 2.25
    assert d.model_ratio("m") == pytest.approx(math.sqrt(2.0))


def test_the_mean_forgets_old_steps_at_rate_alpha():
    d = CostDrift(cost(), alpha=0.5, min_samples=1)
    d.observe("m", A, 0.010)  # log ratio 0
    d.observe("m", A, 0.040)  # weight max(0.5, 1/2) = 0.5: log 4 / 2 -> ratio 2
    d.observe("m", A, 0.040)  # weight 0.5: (log 2 + log 4) / 2 = log(2 ** 1.5)
    assert d.ratio("m", A) == pytest.approx(2 ** 1.5)


def test_corrected_scales_every_cell_and_keeps_accuracy_and_machine():
    d = CostDrift(cost(), min_samples=1)
    d.observe("m", A, 0.030)
    c = d.corrected()
    assert c.latency["m"].latency(A) == pytest.approx(0.030)
    assert c.latency["m"].latency(B) == pytest.approx(0.060)  # the model's 3x
    assert c.accuracy["m"].of("t", 0) == 0.9 and c.machine == "here"


def test_unprofiled_cells_and_bad_times_are_not_recorded():
    d = CostDrift(cost(), min_samples=1)
    assert not d.observe("m", Cell(8, 16), 0.1)
    assert not d.observe("other", A, 0.1)
    assert not d.observe("m", A, 0.0) and not d.observe("m", A, float("nan"))
    assert d.samples("m") == 0


def test_due_after_a_five_percent_move_and_not_again_until_the_next():
    d = CostDrift(cost(), min_samples=1, reprice_step=0.05)
    d.observe("m", A, 0.0104)  # 1.04x
    assert not d.due("m", A)
    d.observe("m", A, 0.0110)  # mean of logs of 1.04 and 1.10: 1.0696x
    assert d.due("m", A)
    d.mark_pushed()
    assert not d.due("m", A) and d.reprices == 1


def test_a_cell_seen_after_a_push_is_not_due_while_it_follows_its_model():
    """A cell first measured after a push was priced then at its model's ratio (the fallback);
    measured at that ratio it moves nothing, so no reprice is due; measured 10% off, one is."""
    d = CostDrift(cost(), min_samples=2)
    for _ in range(4):
        d.observe("m", A, 0.020)  # 2x
    assert d.due("m", A)
    d.mark_pushed()
    for _ in range(2):
        d.observe("m", B, 0.040)  # 2x as well: what the policy was given for B
    assert not d.due("m", B)
    for _ in range(20):
        d.observe("m", B, 0.044)  # 2.2x: 10% above what it was given
    assert d.due("m", B)


@pytest.mark.parametrize("ratio, outside", [(1.31, True), (1.29, False), (1 / 1.29, False), (1 / 1.31, True)])
def test_the_warning_bound_is_thirty_percent_either_way(ratio, outside):
    d = CostDrift(cost(), min_samples=1)
    d.observe("m", A, 0.010 * ratio)
    assert d.outside("m") is outside


def test_deadline_batching_plans_with_the_new_prices_after_reprice():
    """A request of deadline 15 ms fits a 10 ms batch (it waits for an instance) but not a 20 ms
    one: after repricing at 2x the policy evicts it instead of running it late."""
    grid = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16,))
    p = DeadlineBatching({"m": grid}, cost(), max_wait=0.0)
    p.on_arrival(Request(1, 0.0, "m", length=10, deadline=0.015), 0.0)
    assert p.plan(0.001, []).evict == ()  # busy instances: 1 ms + 10 ms < 15 ms, it waits
    p.reprice(cost(0.020, 0.040), 0.001)
    plan = p.plan(0.001, [])
    assert plan.evict == (1,)


def test_arlo_reprices_its_groups_queues_and_its_solver_estimate():
    from jaxserve.sched.arlo import ArloPolicy

    grid = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16, 32))
    table = {Cell(b, s): 0.001 * b * s / 16 for b in (1, 4) for s in (16, 32)}
    base = CostModel({"m": LatencyProfile("m", table)})
    p = ArloPolicy("m", grid, base, slo=0.5, instances=2)
    p.on_arrival(Request(1, 0.0, "m", length=10, deadline=0.5), 0.0)
    (batcher,) = p._batchers.values()
    before = [list(q.latency) for q in batcher._queues]
    estimate = [a.copy() for a in p.runtime.groups.latency]
    p.reprice(CostModel({"m": LatencyProfile("m", {c: 2 * t for c, t in table.items()})}), 0.0)
    assert [list(q.latency) for q in batcher._queues] == [[2 * t for t in row] for row in before]
    for new, old in zip(p.runtime.groups.latency, estimate):
        assert list(new) == pytest.approx([2 * t for t in old])


def test_otas_prices_its_gamma_options_and_its_load_map_at_the_new_prices():
    from jaxserve.sched.otas import OTASPolicy

    grid = ShapeGrid(batch_sizes=(1, 4), gammas=(0, 2))
    table = {Cell(b, 0, g): 0.002 * b * (1 + g) for b in (1, 4) for g in (0, 2)}
    acc = AccuracyProfile("v", {("t", 0): 0.9, ("t", 2): 0.95})
    p = OTASPolicy("v", LatencyProfile("v", table), acc, grid)
    before = {g: p._pricer.seconds(4, g) for g in (0, 2)}
    rates = [rate for _, rate, _ in p.load_map.rows]
    p.reprice(CostModel({"v": LatencyProfile("v", {c: 2 * t for c, t in table.items()})}), 0.0)
    assert {g: p._pricer.seconds(4, g) for g in (0, 2)} == pytest.approx({g: 2 * t for g, t in before.items()})
    assert [rate for _, rate, _ in p.load_map.rows] == pytest.approx([r / 2 for r in rates])
    assert p._pricer.accuracy is acc  # prices change, accuracy stays


def test_tabi_reprices_the_batching_of_every_level():
    from jaxserve.sched.tabi import Candidate, TabiPolicy

    grid = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16,))
    cand = Candidate("t", ("m",))
    p = TabiPolicy({"t": cand}, {"m": grid}, cost(), {"t": ("a", "b")}, max_wait=0.0)
    p.reprice(cost(0.020, 0.040), 0.0)
    assert p.batching.cost_model.latency["m"].latency(A) == 0.020
    (q,) = [q for q in p.batching._queues if q.model == "m"]
    assert q.latency1 == pytest.approx(0.020)
