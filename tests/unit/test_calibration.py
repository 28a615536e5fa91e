"""Temperature scaling, the logistic-regression head and TaskHead's temperature, on synthetic data.

Contracts: fit_temperature recovers the temperature of logits with a known miscalibration and lowers
their NLL (and ECE); it leaves calibrated logits at T ~ 1; the logistic regression reaches a linearly
separable problem's labels; a TaskHead's temperature divides its logits, survives save/load, and a
head file saved without one loads with 1.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.runtime import TaskHead
from training.calibration import (expected_calibration_error, fit_logistic_regression, fit_temperature,
                                  negative_log_likelihood, softmax)


def sampled(n=20_000, classes=4, scale=2.0, seed=0):
    """Calibrated logits z and labels drawn from softmax(z)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, classes)) * scale
    p = softmax(z)
    labels = (p.cumsum(-1) > rng.random((n, 1))).argmax(-1)
    return z, labels


@pytest.mark.parametrize("true_t", [0.5, 2.5])
def test_temperature_recovers_known_miscalibration_and_lowers_nll(true_t):
    z, labels = sampled()
    miscalibrated = z * true_t  # dividing by true_t gives back the calibrated logits
    t = fit_temperature(miscalibrated, labels)
    assert t == pytest.approx(true_t, rel=0.05)
    before = negative_log_likelihood(softmax(miscalibrated), labels)
    after = negative_log_likelihood(softmax(miscalibrated / t), labels)
    assert after < before - 0.02
    assert expected_calibration_error(softmax(miscalibrated / t), labels) < expected_calibration_error(
        softmax(miscalibrated), labels)


def test_calibrated_logits_keep_temperature_one():
    z, labels = sampled(seed=1)
    assert fit_temperature(z, labels) == pytest.approx(1.0, abs=0.05)


def test_ece_of_a_perfectly_confident_correct_predictor_is_zero_and_of_a_wrong_one_is_one():
    labels = np.array([0, 1, 2, 1])
    right = np.eye(3)[labels]
    assert expected_calibration_error(right, labels) == 0.0
    assert expected_calibration_error(np.eye(3)[(labels + 1) % 3], labels) == 1.0


def test_logistic_regression_fits_a_separable_problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2_000, 20)).astype(np.float32)
    labels = (x @ rng.normal(size=(20, 3))).argmax(-1)
    params, losses = fit_logistic_regression(x, labels, 3, l2=1e-4)
    assert params["weight"].shape == (20, 3) and params["bias"].shape == (3,)
    assert losses[-1] < 0.25 * losses[0]
    assert ((x @ params["weight"] + params["bias"]).argmax(-1) == labels).mean() > 0.97


def test_task_head_temperature_round_trip_and_effect(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(8, 3)).astype(np.float32)
    bias = rng.normal(size=3).astype(np.float32)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    head = TaskHead("t", ("a", "b", "c"), weight, bias, accuracy=0.5, temperature=2.0)
    head.save(tmp_path / "t.npz")
    loaded = TaskHead.load("t", tmp_path / "t.npz")
    assert loaded.temperature == 2.0 and loaded.accuracy == 0.5
    np.testing.assert_allclose(loaded.probabilities(x), softmax((x @ weight + bias) / 2.0), rtol=1e-5, atol=1e-6)
    plain = TaskHead("t", ("a", "b", "c"), weight, bias)
    assert (plain.probabilities(x).argmax(-1) == loaded.probabilities(x).argmax(-1)).all()
    assert plain.probabilities(x).max(-1).mean() > loaded.probabilities(x).max(-1).mean()  # T > 1 softens


def test_head_file_without_temperature_loads_with_one(tmp_path):
    weight, bias = np.ones((4, 2), np.float32), np.zeros(2, np.float32)
    np.savez(tmp_path / "old.npz", labels=np.array(["x", "y"]), weight=weight, bias=bias,
             feature=np.array("embedding"), accuracy=np.array(-1.0))  # the format before temperature
    assert TaskHead.load("old", tmp_path / "old.npz").temperature == 1.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_is_refused(bad):
    with pytest.raises(ValueError, match="temperature"):
        TaskHead("t", ("a", "b"), np.ones((4, 2), np.float32), np.zeros(2, np.float32), temperature=bad)
