"""The shared attention core gives the textbook softmax attention's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.attention import attention


def _textbook(q, k, v, key_bias):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if key_bias is not None:
        logits = logits + key_bias[:, None, None, :]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_the_textbook_softmax(with_bias):
    rng = np.random.default_rng(0)
    b, s, h, d = 3, 24, 4, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)) * 2, jnp.float32) for _ in range(3))
    bias = None
    if with_bias:  # padding keys in the last row, a log-size bias elsewhere (ToMe)
        bias = jnp.asarray(np.log(rng.integers(1, 4, (b, s))), jnp.float32).at[-1, s // 2:].set(-1e9)
    out = jax.jit(attention)(q, k, v, bias)
    np.testing.assert_allclose(out, _textbook(q, k, v, bias), atol=1e-5)
    if with_bias:  # the padded keys contribute nothing: dropping them gives the same last row
        kept = jax.jit(attention)(q[-1:, :], k[-1:, : s // 2], v[-1:, : s // 2], bias[-1:, : s // 2])
        np.testing.assert_allclose(out[-1:], kept, atol=1e-5)
