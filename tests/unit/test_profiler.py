"""Bucket selection from a measured latency curve."""

import itertools

import numpy as np
import pytest

from jaxserve.profiler import buckets_for_distribution, buckets_from_latencies


def expected_cost(buckets, lengths, seconds, observed):
    t = dict(zip(lengths, np.maximum.accumulate(seconds)))
    return sum(t[min(b for b in buckets if b >= max(o, 1))] for o in observed)


def test_tolerance_rule_lands_on_staircase_edges():
    lengths = list(range(8, 257, 8))
    seconds = [1.0 + (l - 1) // 64 for l in lengths]  # flat steps of 64 tokens, like Arlo's GPU
    assert buckets_from_latencies(lengths, seconds, tolerance=0.1) == (64, 128, 192, 256)


def test_tolerance_rule_widens_to_respect_the_bucket_cap():
    lengths = list(range(8, 513, 8))
    seconds = [0.001 * l for l in lengths]
    assert len(buckets_from_latencies(lengths, seconds, tolerance=0.01, max_buckets=6)) <= 6


@pytest.mark.parametrize("seed", range(5))
def test_distribution_dp_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = list(range(8, 97, 8))
    seconds = np.cumsum(rng.uniform(0.1, 1.0, len(lengths)))
    observed = rng.integers(1, 97, 200)
    got = buckets_for_distribution(lengths, seconds, observed, num_buckets=3, max_ratio=100)
    assert got[-1] == 96 and len(got) <= 3
    best = min(
        (expected_cost(c + (96,), lengths, seconds, observed), c + (96,))
        for k in range(0, 3) for c in itertools.combinations(lengths[:-1], k)
    )
    assert expected_cost(got, lengths, seconds, observed) == pytest.approx(best[0])


def test_distribution_dp_respects_max_ratio():
    lengths = list(range(8, 257, 8))
    seconds = [0.001 * l for l in lengths]
    observed = [10] * 1000  # all traffic is short: the DP alone would jump 16 -> 256
    got = buckets_for_distribution(lengths, seconds, observed, num_buckets=8, max_ratio=2.0)
    assert all(b <= 2 * a for a, b in zip(got, got[1:])), got
    assert got[-1] == 256
