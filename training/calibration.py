"""Linear heads on frozen features and their calibration: multinomial logistic regression fitted with
optax (full-batch L-BFGS), temperature scaling, and the metrics that judge them (NLL, ECE).

Contracts:

- :func:`fit_logistic_regression` minimises ``mean_i w_i * CE(x_i W + b, y_i) / mean_i w_i +
  l2 / 2 * ||W||^2`` (the bias is not penalised) on the features as given; callers standardise.
- :func:`fit_temperature` returns the scalar T > 0 that minimises the mean NLL of
  ``softmax(logits / T)`` (Guo et al. 2017, "On Calibration of Modern Neural Networks"); it never
  changes a prediction, only confidence. NLL as a function of 1/T is convex, so the optimum is unique.
- :func:`expected_calibration_error`: equal-width confidence bins (15 by default) over the top-class
  probability, ``sum_b |B_b| / N * |accuracy(B_b) - mean confidence(B_b)|``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean -log p(true label), with p clipped at 1e-12 (a float16 0 must not give infinity)."""
    p = np.asarray(probabilities, np.float64)[np.arange(len(labels)), labels]
    return float(-np.log(np.clip(p, 1e-12, None)).mean())


def expected_calibration_error(probabilities: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """ECE over ``bins`` equal-width bins of the top-class probability (see the module docstring)."""
    p = np.asarray(probabilities, np.float64)
    confidence = p.max(axis=-1)
    correct = p.argmax(axis=-1) == labels
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


@partial(jax.jit, static_argnames=("steps",))
def _temperature_lbfgs(logits: jax.Array, labels: jax.Array, steps: int) -> jax.Array:
    def nll(log_t):
        return optax.softmax_cross_entropy_with_integer_labels(logits / jnp.exp(log_t), labels).mean()

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(nll)

    def step(carry, _):
        log_t, state = carry
        value, grad = value_and_grad(log_t, state=state)
        updates, state = opt.update(grad, state, log_t, value=value, grad=grad, value_fn=nll)
        return (optax.apply_updates(log_t, updates), state), value

    log_t = jnp.zeros(())
    (log_t, _), _ = jax.lax.scan(step, (log_t, opt.init(log_t)), None, length=steps)
    return jnp.exp(log_t)


def fit_temperature(logits: np.ndarray, labels: np.ndarray, steps: int = 50) -> float:
    """The temperature T minimising the mean NLL of ``softmax(logits / T)`` on (logits, labels),
    found by optax L-BFGS over log T from T = 1 (so T > 0). Clipped to [0.05, 20]."""
    t = float(_temperature_lbfgs(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32), steps))
    if not np.isfinite(t):
        raise FloatingPointError("temperature fitting diverged")
    return float(np.clip(t, 0.05, 20.0))


@partial(jax.jit, static_argnames=("steps",))
def _logreg_lbfgs(x, y, sample_weight, l2, init, steps: int):
    def loss(params):
        logits = x @ params["weight"] + params["bias"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return (sample_weight * ce).sum() / sample_weight.sum() + 0.5 * l2 * jnp.sum(params["weight"] ** 2)

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def step(carry, _):
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=loss)
        return (optax.apply_updates(params, updates), state), value

    (params, _), values = jax.lax.scan(step, (init, opt.init(init)), None, length=steps)
    return params, values


def fit_logistic_regression(features: np.ndarray, labels: np.ndarray, classes: int, l2: float,
                            sample_weight: np.ndarray | None = None, steps: int = 150) -> tuple[dict, np.ndarray]:
    """({'weight' [D, C], 'bias' [C]} as numpy float32, loss per step) of the L2-regularised
    multinomial logistic regression in the module docstring, ``steps`` full-batch L-BFGS steps from
    zero (the problem is convex)."""
    x = jnp.asarray(features, jnp.float32)
    y = jnp.asarray(labels, jnp.int32)
    w = jnp.ones(len(labels), jnp.float32) if sample_weight is None else jnp.asarray(sample_weight, jnp.float32)
    init = {"weight": jnp.zeros((x.shape[1], classes), jnp.float32), "bias": jnp.zeros((classes,), jnp.float32)}
    params, values = _logreg_lbfgs(x, y, w, jnp.float32(l2), init, steps)
    return {k: np.asarray(v, np.float32) for k, v in params.items()}, np.asarray(values)
