"""Workload traces: statistics for fixed seeds, bounds, and exact replay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.traces import (
    Trace,
    TraceRequest,
    fluctuating_poisson_arrivals,
    gamma_arrivals,
    load_trace,
    make_trace,
    merge_traces,
    mmpp_arrivals,
    poisson_arrivals,
    sample_lengths,
    save_trace,
)

N = 20_000


def cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_poisson_rate_and_cv(seed):
    a = poisson_arrivals(100.0, n=N, seed=seed)
    assert len(a) == N and np.all(np.diff(a) >= 0) and a[0] > 0
    assert 1 / np.diff(a).mean() == pytest.approx(100.0, rel=0.03)  # 4 sigma
    assert cv(a) == pytest.approx(1.0, abs=0.04)


def test_poisson_duration_bound_counts_match_rate():
    a = poisson_arrivals(100.0, duration=200.0, seed=3)
    assert a[-1] < 200.0
    assert len(a) == pytest.approx(20_000, abs=4 * math.sqrt(20_000))


def test_both_bounds_stop_at_whichever_comes_first():
    assert len(poisson_arrivals(100.0, n=50, duration=1000.0, seed=0)) == 50
    a = poisson_arrivals(100.0, n=10**6, duration=1.0, seed=0)
    assert a[-1] < 1.0 and len(a) < 200
    with pytest.raises(ValueError):
        poisson_arrivals(100.0, seed=0)  # unbounded


def test_same_seed_same_trace_and_generator_seeds_accepted():
    assert np.array_equal(poisson_arrivals(5.0, n=100, seed=9), poisson_arrivals(5.0, n=100, seed=9))
    assert not np.array_equal(poisson_arrivals(5.0, n=100, seed=9), poisson_arrivals(5.0, n=100, seed=10))
    a = gamma_arrivals(5.0, 2.0, n=100, seed=np.random.default_rng(4))
    b = gamma_arrivals(5.0, 2.0, n=100, seed=np.random.default_rng(4))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("target_cv", [0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(target_cv):
    a = gamma_arrivals(200.0, target_cv, n=N, seed=1)
    assert 1 / np.diff(a).mean() == pytest.approx(200.0, rel=0.03 * max(1, target_cv))
    assert cv(a) == pytest.approx(target_cv, rel=0.1)


def test_gamma_cv_zero_is_evenly_spaced():
    a = gamma_arrivals(4.0, 0.0, n=9, seed=0)
    assert np.allclose(a, np.arange(1, 10) * 0.25)


def test_mmpp_is_bursty_with_the_stationary_mean_rate():
    rates, durations = (20.0, 200.0), (1.0, 0.25)
    mean_rate = (20.0 * 1.0 + 200.0 * 0.25) / 1.25  # 56 / s
    a = mmpp_arrivals(rates, durations, n=N, seed=2)
    assert len(a) == N and np.all(np.diff(a) >= 0)
    assert len(a) / a[-1] == pytest.approx(mean_rate, rel=0.1)
    assert cv(a) > 1.3  # Poisson would be 1
    b = mmpp_arrivals(rates, durations, duration=100.0, seed=2)
    assert b[-1] < 100.0 and len(b) == pytest.approx(5600, rel=0.2)


def test_mmpp_with_equal_rates_is_poisson():
    a = mmpp_arrivals((100.0, 100.0), (0.5, 0.5), n=N, seed=0)
    assert cv(a) == pytest.approx(1.0, abs=0.04)


def test_fluctuating_poisson_follows_the_rate_of_each_segment():
    a = fluctuating_poisson_arrivals([50.0, 200.0], 10.0, duration=200.0, seed=5)
    segment = (a // 10.0).astype(int)
    counts = np.bincount(segment, minlength=20)
    low, high = counts[0::2].sum(), counts[1::2].sum()  # 10 segments of each, 10 s long
    assert low == pytest.approx(5_000, abs=4 * math.sqrt(5_000))
    assert high == pytest.approx(20_000, abs=4 * math.sqrt(20_000))
    # per-segment lengths
    b = fluctuating_poisson_arrivals([100.0, 0.0], [1.0, 3.0], duration=40.0, seed=1)
    assert np.all(b % 4.0 < 1.0)  # nothing arrives while the rate is 0


def test_sample_lengths_fixed_and_empirical():
    assert np.array_equal(sample_lengths(17, 5, seed=0), [17] * 5)
    empirical = np.array([5, 5, 5, 40])
    s = sample_lengths(empirical, N, seed=0)
    assert set(np.unique(s)) == {5, 40}
    assert np.mean(s == 40) == pytest.approx(0.25, abs=0.015)


def test_make_trace_and_iteration():
    t = make_trace([0.5, 1.0, 2.0], model="bert", task="sst2", length=[3, 4, 5], slo_s=0.1)
    assert len(t) == 3
    assert t[1] == TraceRequest(1.0, 4, 0.1, 1.0, "bert", "sst2")
    assert list(t)[2] == t[2]
    assert t[2].deadline == 2.0 + 0.1
    assert np.array_equal(t.deadline, t.arrival + 0.1)
    with pytest.raises(ValueError):
        make_trace([1.0, 0.5])  # unsorted
    with pytest.raises(ValueError):
        make_trace([0.5, 1.0], length=[1, 2, 3])
    with pytest.raises(ValueError):
        t.arrival[0] = 9.0  # read-only


def test_merge_traces_sorts_stably():
    a = make_trace([0.0, 1.0, 2.0], model="a")
    b = make_trace([0.5, 1.0, 3.0], model="b")
    m = merge_traces(a, b)
    assert m.arrival.tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 3.0]
    assert m.model.tolist() == ["a", "b", "a", "b", "a", "b"]


def test_replay_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    n = 2000
    arrivals = gamma_arrivals(300.0, 3.0, n=n, seed=1)
    slo = rng.uniform(0.01, 1.0, n)
    slo[::7] = math.inf
    slo[1::7] = 0.1
    trace = make_trace(
        arrivals,
        model=rng.choice(["bert", "vit"], n),
        task=rng.choice(["sst2", "", "imdb"], n),
        length=rng.integers(0, 512, n),
        slo_s=slo,
        utility=rng.random(n),
    )
    path = tmp_path / "t.csv"
    save_trace(path, trace)
    assert path.read_text().splitlines()[0] == "arrival,length,slo_ms,utility,model,task"
    back = load_trace(path)
    assert back == trace
    assert np.array_equal(back.slo_s, trace.slo_s)  # bit-exact, not approximately


def test_replay_without_model_columns(tmp_path):
    trace = make_trace([0.25, 0.75], length=[10, 20], slo_s=0.05, utility=2.0)
    path = tmp_path / "t.csv"
    save_trace(path, trace)
    assert path.read_text().splitlines()[0] == "arrival,length,slo_ms,utility"
    assert load_trace(path) == trace
    # a recorded file: unsorted rows, model/task columns present
    path.write_text("arrival,length,slo_ms,utility,model,task\n2.0,5,100,1,bert,x\n1.0,6,inf,0.5,vit,\n")
    t = load_trace(path)
    assert t.arrival.tolist() == [1.0, 2.0] and t.model.tolist() == ["vit", "bert"]
    assert t.slo_s.tolist() == [math.inf, 0.1] and t.length.tolist() == [6, 5]


def test_load_rejects_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("arrival,length\n0.1,3\n")
    with pytest.raises(ValueError):
        load_trace(path)


def test_empty_trace():
    t = Trace.from_requests([])
    assert len(t) == 0 and t.duration == 0.0 and t.mean_rate() == 0.0
