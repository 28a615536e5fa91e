"""bench/fidelity.py's simulated arms on hand-made calibrations: the correlated arm keeps the
order of the slow-downs it replays (runs stay runs), the independent arm scatters them, and
both keep each batch size's mean ratio. Expectations are worked from the calibrations."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fidelity import Calibration, correlated_service, empirical_service, live_prices
from jaxserve.sched.base import Batch, Cell, CostModel, LatencyProfile

MODEL = "m"
COST = CostModel({MODEL: LatencyProfile(MODEL, {Cell(1, 64): 0.010, Cell(4, 64): 0.030})})


def calibration(ratios, sizes, handoffs=None) -> Calibration:
    ratios = np.asarray(ratios, float)
    handoffs = np.zeros_like(ratios) if handoffs is None else np.asarray(handoffs, float)
    return Calibration(ratios, handoffs, np.asarray(sizes), float(ratios.mean()), tuple(Cell(b, 64) for b in sizes))


def runs_of(slow_then_fast: int, n: int) -> np.ndarray:
    """n batches alternating runs of ``slow_then_fast`` slow (x2) and as many fast (x1) ones."""
    return np.array([2.0 if (k // slow_then_fast) % 2 == 0 else 1.0 for k in range(n)])


def draws(service, cell: Cell, n: int) -> np.ndarray:
    batch = Batch(tuple(range(cell.batch)), MODEL, cell, 0)
    return np.array([service(batch) for _ in range(n)])


def lag1(x: np.ndarray) -> float:
    return float(np.corrcoef(x[:-1], x[1:])[0, 1])


def test_lag1_and_block_follow_the_calibration_order():
    runs = calibration(runs_of(10, 400), [1] * 400)
    # 10-long runs: 9 of every 10 neighbours agree, so the lag-1 correlation of +-a is 0.8
    assert abs(runs.lag1 - 0.8) < 0.02
    assert abs(runs.block - (1 + runs.lag1) / (1 - runs.lag1)) < 1e-9
    alternating = calibration(runs_of(1, 400), [1] * 400)
    assert alternating.lag1 < -0.99 and alternating.block == 1.0  # negative: no runs to keep
    tiny = calibration(runs_of(10, 8), [1] * 8)
    assert tiny.block <= 2.0  # at most a quarter of the batches


def test_correlated_draws_keep_runs_and_independent_draws_do_not():
    cal = calibration(runs_of(20, 400), [1] * 400)
    cell = Cell(1, 64)
    corr = draws(correlated_service(COST, cal, seed=0, model=MODEL), cell, 4000)
    indep = draws(empirical_service(COST, cal, seed=0, model=MODEL), cell, 4000)
    assert lag1(corr) > 0.6
    assert abs(lag1(indep)) < 0.1
    # both keep the mean: slow and fast halves, 0.010 s x 1.5 on average
    for x in (corr, indep):
        assert abs(x.mean() - 0.015) < 0.0015
        assert set(np.round(x, 9)) == {0.01, 0.02}


def test_a_batch_size_keeps_its_own_mean_ratio_and_the_hand_off_travels_with_its_batch():
    # 40 batches of 1 at ratio 1.0-ish, 40 of 4 at 3.0-ish, interleaved; hand-off 1 ms on the 4s
    sizes = [1, 4] * 40
    ratios = [1.0 if b == 1 else 3.0 for b in sizes]
    handoffs = [0.0 if b == 1 else 0.001 for b in sizes]
    cal = calibration(ratios, sizes, handoffs)
    assert cal.size_means() == {1: 1.0, 4: 3.0}
    np.testing.assert_allclose(cal.slowness(), 1.0)
    service = correlated_service(COST, cal, seed=1, model=MODEL)
    small, big = draws(service, Cell(1, 64), 200), draws(service, Cell(4, 64), 200)
    # the price is the size's own mean ratio x slowness 1, plus whichever batch's hand-off came up
    assert set(np.round(small, 9)) <= {0.010, 0.011}
    assert set(np.round(big, 9)) <= {0.090, 0.091}


def test_live_prices_correct_each_cell_by_its_own_ratio_once_it_has_eight_steps():
    # 20 batches of 1 at x2, then 5 of 4 at x3: the 1s' cell has its own ratio; the 4s' cell,
    # with fewer than 8 steps, falls back to the model's running ratio (alpha 0.05, log space)
    cal = calibration([2.0] * 20 + [3.0] * 5, [1] * 20 + [4] * 5)
    prices = live_prices(COST, cal, MODEL).latency[MODEL]
    assert abs(prices.latency(Cell(1, 64)) - 0.020) < 1e-12
    mean = 0.0
    for n, r in enumerate([2.0] * 20 + [3.0] * 5, start=1):
        mean += max(0.05, 1 / n) * (np.log(r) - mean)
    assert abs(prices.latency(Cell(4, 64)) - 0.030 * np.exp(mean)) < 1e-12
    assert 2.0 < np.exp(mean) < 3.0


def test_as_sent_moves_each_request_to_when_it_left_the_client_with_its_own_fields():
    from bench.fidelity import as_sent
    from jaxserve.traces import make_trace

    trace = make_trace([0.0, 0.1, 0.2, 0.3], model="m", task=["a", "b", "c", "d"], length=[5, 6, 7, 8],
                       slo_s=[1.0, 2.0, 3.0, 4.0], utility=[1.0, 0.2, 1.0, 0.2])
    # the second request left late, after the third; the fourth was never sent; a negative lag is clock noise
    moved = as_sent(trace, np.array([-0.001, 0.15, 0.0, np.nan]))
    np.testing.assert_allclose(moved.arrival, [0.0, 0.2, 0.25, 0.3])
    assert list(moved.task) == ["a", "c", "b", "d"] and list(moved.length) == [5, 7, 6, 8]
    np.testing.assert_allclose(moved.slo_s, [1.0, 3.0, 2.0, 4.0])
    np.testing.assert_allclose(moved.utility, [1.0, 1.0, 0.2, 0.2])


def _cell(policy, load, factor, sigma, handoff_ms, sim_mean=12.0, live_mean=10.0):
    return {"policy": policy, "model": MODEL, "load": load, "rate": 10.0 * load,
            "calibration": {"factor": factor, "sigma": sigma, "handoff_ms": handoff_ms},
            "sim": {"lognormal": {"mean": sim_mean, "p98": 30.0}}, "live": {"mean": live_mean, "p98": 40.0}}


def test_a_fidelity_run_saves_its_calibrations_with_the_cost_model_they_are_ratios_to(tmp_path):
    """What sim_knee and fidelity_sensitivity read back: the servers' cost model, each cell's ratio,
    sigma, hand-off (in seconds) and log-normal error; the typical calibration is the median of a
    policy's cells; a missing cell names the cells there are, and a file that is not one names itself."""
    from bench.fidelity import calibration_of, load_calibrations, save_calibrations, typical_calibration

    cost_path = tmp_path / "cost_model.json"
    cost_path.write_text(COST.to_json())
    cells = [_cell("default", 0.3, 1.0, 0.2, 0.5), _cell("default", 0.7, 1.3, 0.4, 0.9),
             _cell("default", 0.9, 1.1, 0.3, 2.0), _cell("otas", 0.3, 0.8, 0.1, 1.0)]
    path = save_calibrations(tmp_path / "cal.json", cost_path, cells)
    cost, back = load_calibrations(path)
    assert cost.latency[MODEL].seconds == COST.latency[MODEL].seconds
    c = calibration_of(back, "default", 0.7)
    assert (c["factor"], c["sigma"], c["handoff_s"]) == (1.3, 0.4, pytest.approx(0.9e-3))
    assert c["lognormal_error_pct"] == [pytest.approx(20.0), pytest.approx(-25.0)]  # (12-10)/10, (30-40)/40
    t = typical_calibration(back, "default")
    assert (t["factor"], t["sigma"], t["handoff_s"]) == (1.1, 0.3, pytest.approx(0.9e-3))
    with pytest.raises(ValueError, match="have: default at 30%, default at 70%, default at 90%, otas at 30%"):
        calibration_of(back, "arlo", 0.7)
    with pytest.raises(ValueError, match="no fidelity calibration for arlo"):
        typical_calibration(back, "arlo")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json holds no fidelity calibration"):
        load_calibrations(bad)
