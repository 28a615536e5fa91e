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


# ----------------------------------------------------------------- the fused CPU kernel

from jaxserve import kernels  # noqa: E402
from jaxserve.models.attention import qkv_attention  # noqa: E402


def _packed(b, s, h, d, *, seed=0, amp=2.0, pad_rows=True):
    """Random qkv [B,S,3,H,D] and a key bias: padding (-1e9) after a random length per row,
    one row entirely padding (a padded batch slot), ToMe-like log sizes elsewhere."""
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, s, 3, h, d)) * amp, jnp.float32)
    bias = np.log(rng.integers(1, 4, (b, s))).astype(np.float32)
    lengths = rng.integers(1, s + 1, b)
    bias[np.arange(s)[None, :] >= lengths[:, None]] = -1e9
    if pad_rows and b > 1:
        bias[-1] = -1e9
    return qkv, jnp.asarray(bias)


def _both(qkv, bias, scale):
    fused = jax.jit(qkv_attention, static_argnums=2)
    with kernels.xla_attention():
        reference = jax.jit(lambda x, y: qkv_attention(x, y, scale))(qkv, bias)  # traced as XLA ops
    return fused(qkv, bias, scale), reference


def test_the_kernel_builds_and_serves_attention_here():
    """The CPU this runs on has a C++ compiler: the kernel must build, and models must call it."""
    kernel = kernels.fused_attention_kernel()
    assert kernel is not None, "the fused attention kernel did not build: see the jaxserve.kernels warning"
    assert kernels.attention_impl() == "fused" and kernels.attention_fingerprint() == f"fused:{kernel.build_id}"
    qkv, bias = _packed(2, 16, 2, 8)
    hlo = jax.jit(qkv_attention, static_argnums=2).lower(qkv, bias, 0.5).as_text()
    assert kernels.ATTENTION_TARGET in hlo
    with kernels.xla_attention():
        assert kernels.ATTENTION_TARGET not in jax.jit(qkv_attention, static_argnums=2).lower(qkv, bias, 0.5).as_text()
        assert kernels.attention_fingerprint() == "xla"


@pytest.mark.parametrize("b,s,h,d", [
    (1, 1, 1, 8),      # one token
    (3, 7, 2, 16),     # S under one vector, D under one register tile
    (2, 25, 3, 24),    # D not a multiple of the vector width, S one past a query block
    (4, 37, 12, 32),   # MiniLM's heads; S tail panels
    (2, 48, 4, 64),    # two whole query blocks
    (2, 100, 3, 72),   # D over one PV tile
    (2, 197, 12, 64),  # ViT-B/16's token count
    (1, 256, 12, 32),  # a MiniLM bucket
])
def test_fused_kernel_matches_the_xla_form(b, s, h, d):
    qkv, bias = _packed(b, s, h, d, seed=s + d)
    fused, reference = _both(qkv, bias, float(d) ** -0.5)
    np.testing.assert_allclose(fused, reference, atol=2e-5, rtol=1e-5)


def test_fused_kernel_without_a_bias_is_plain_softmax_attention():
    qkv, _ = _packed(2, 33, 3, 16)
    fused, reference = _both(qkv, None, 0.25)
    np.testing.assert_allclose(fused, reference, atol=2e-5, rtol=1e-5)
    q, k, v = qkv[:, :, 0] * 0.25, qkv[:, :, 1], qkv[:, :, 2]
    np.testing.assert_allclose(fused, _textbook(q, k, v, None), atol=2e-5, rtol=1e-5)


def test_padded_keys_contribute_exactly_nothing():
    """A padded key's weight is exactly 0 (not e^-87): a row gives the same numbers whatever
    the padding after it, which is what makes every bucket agree."""
    qkv, _ = _packed(1, 40, 2, 16, pad_rows=False)
    short = jax.jit(qkv_attention, static_argnums=2)(qkv[:, :24], jnp.zeros((1, 24)), 0.25)
    garbage = qkv.at[:, 24:].multiply(1e3)  # whatever sits in the padding
    bias = jnp.where(jnp.arange(40) < 24, 0.0, -1e9)[None, :]
    long = jax.jit(qkv_attention, static_argnums=2)(garbage, bias, 0.25)
    np.testing.assert_allclose(long[:, :24], short, atol=1e-6, rtol=1e-6)


def _float64_attention(qkv, bias, scale):
    x = np.asarray(qkv, np.float64)
    scores = np.einsum("bqhd,bkhd->bhqk", x[:, :, 0] * np.float32(scale), x[:, :, 1]) + np.asarray(bias)[:, None, None]
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), x[:, :, 2])


@pytest.mark.parametrize("amp", [1.0, 6.0])
def test_as_accurate_as_the_xla_form(amp):
    """Against float64, the kernel's error is no larger than XLA's own float32 form, also with
    scores in the hundreds (amp 6: a sharp softmax that neither overflows nor loses its max
    term). The last row is a padded batch slot: every key at -1e9, where float32's spacing
    (128) swamps the scores, so any float32 form averages noise there; it must only be finite."""
    qkv, bias = _packed(3, 64, 2, 32, amp=amp)
    fused, reference = _both(qkv, bias, 1.0 if amp > 1 else 0.2)
    truth = _float64_attention(qkv, bias, 1.0 if amp > 1 else 0.2)
    assert np.isfinite(np.asarray(fused)).all()
    err_fused = np.abs(np.asarray(fused)[:-1] - truth[:-1]).max()
    err_xla = np.abs(np.asarray(reference)[:-1] - truth[:-1]).max()
    assert err_fused <= 2 * err_xla + 1e-6, (err_fused, err_xla)


def test_sixteen_lane_build_gives_the_same_numbers(tmp_path):
    """The AVX-512 width (16 lanes, other tails and panels) built here as portable vector
    code and run beside the default build: same results."""
    wide = kernels.build_kernel(target="jaxserve_test_attention_w16", defines={"JAXSERVE_VEC_BYTES": "64"},
                                directory=tmp_path)
    for b, s, h, d in [(2, 197, 3, 64), (3, 21, 2, 24), (2, 70, 4, 16)]:
        qkv, bias = _packed(b, s, h, d, seed=d)
        call = jax.ffi.ffi_call(wide.target, jax.ShapeDtypeStruct((b, s, h, d), jnp.float32))
        out = jax.jit(lambda x, y: call(x, y, scale=np.float32(0.125)))(qkv, bias)
        fused, reference = _both(qkv, bias, 0.125)
        np.testing.assert_allclose(out, fused, atol=2e-6, rtol=1e-6)
        np.testing.assert_allclose(out, reference, atol=2e-5, rtol=1e-5)


def test_gradients_flow_through_the_fused_call():
    """Prompt training differentiates through attention: the kernel's custom VJP gives the
    XLA form's gradients, for qkv and for the key bias."""
    qkv, bias = _packed(2, 20, 2, 16, pad_rows=False)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((2, 20, 2, 16)), jnp.float32)

    def loss(x, y):
        return (qkv_attention(x, y, 0.25) * w).sum()

    g_fused = jax.jit(jax.grad(loss, argnums=(0, 1)))(qkv, bias)
    with kernels.xla_attention():
        g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(qkv, bias)
    for a, r in zip(g_fused, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)


def test_vmap_over_the_fused_call():
    qkv, bias = _packed(3, 12, 2, 8)
    stacked, biases = jnp.stack([qkv, qkv * 0.5]), jnp.stack([bias, bias])
    out = jax.jit(jax.vmap(lambda x, y: qkv_attention(x, y, 0.3)))(stacked, biases)
    for i in range(2):
        np.testing.assert_allclose(out[i], _both(stacked[i], biases[i], 0.3)[1], atol=2e-5, rtol=1e-5)


def test_a_failed_build_falls_back_to_xla_ops(monkeypatch, tmp_path, caplog):
    """No usable compiler: the build raises naming the compiler, the process runs attention as
    XLA ops (with a warning), and cache keys say so."""
    monkeypatch.setattr(kernels, "_compiler", lambda: "/bin/false")
    monkeypatch.setenv("JAXSERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.raises(RuntimeError, match="false failed"):
        kernels.build_kernel(target="jaxserve_test_never_registered")
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written left behind
    kernels.fused_attention_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="jaxserve.kernels"):
            assert kernels.fused_attention_kernel() is None
        assert "attention runs as XLA ops" in caplog.text
        assert kernels.attention_impl() == "xla" and kernels.attention_fingerprint() == "xla"
        qkv, bias = _packed(2, 9, 2, 8)
        assert kernels.ATTENTION_TARGET not in jax.jit(qkv_attention, static_argnums=2).lower(qkv, bias, 0.5).as_text()
    finally:
        kernels.fused_attention_kernel.cache_clear()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_FUSED_ATTENTION", "0")
    kernels.fused_attention_kernel.cache_clear()
    try:
        assert kernels.fused_attention_kernel() is None and kernels.attention_fingerprint() == "xla"
    finally:
        kernels.fused_attention_kernel.cache_clear()


def test_a_kernel_directory_others_can_write_is_refused(tmp_path):
    """The kernel is native code this process loads: trusted code, like the compile cache."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        kernels.build_kernel(target="jaxserve_test_never_registered", directory=shared)
    ours = tmp_path / "ours"
    built = kernels.build_kernel(target="jaxserve_test_attention_perm", directory=ours)
    assert oct(ours.stat().st_mode & 0o777) == "0o700" and oct(built.path.stat().st_mode & 0o777) == "0o700"
    built.path.chmod(0o770)  # tampered with: a group member could have replaced it
    with pytest.raises(PermissionError, match="writable by others"):
        kernels.build_kernel(target="jaxserve_test_attention_perm2", directory=ours)


# ------------------------------------------------ a per-head [H, S, S] bias (MPNet's positions)

def _pos_bias(h, s, seed=0, amp=3.0):
    return jnp.asarray(np.random.default_rng(seed + 7).standard_normal((h, s, s)) * amp, jnp.float32)


def _both_pos(qkv, bias, pos, scale):
    fn = jax.jit(lambda x, y, z: qkv_attention(x, y, scale, z))
    with kernels.xla_attention():
        reference = jax.jit(lambda x, y, z: qkv_attention(x, y, scale, z))(qkv, bias, pos)
    return fn(qkv, bias, pos), reference


@pytest.mark.parametrize("b,s,h,d", [
    (1, 1, 1, 8), (3, 7, 2, 16), (2, 25, 3, 24), (4, 37, 12, 32), (2, 100, 3, 72), (1, 256, 12, 64),
])
def test_fused_kernel_with_a_position_bias_matches_the_xla_form(b, s, h, d):
    """The kernel's position-bias target (added per query block in cache, the row max taken
    again) gives the XLA form's numbers, padding rows and odd tails included; the traced
    program calls that target, and the key-bias-only one where there is no position bias."""
    qkv, bias = _packed(b, s, h, d, seed=s + d)
    pos = _pos_bias(h, s, seed=s)
    hlo = jax.jit(lambda x, y, z: qkv_attention(x, y, 0.3, z)).lower(qkv, bias, pos).as_text()
    assert kernels.ATTENTION_POS_BIAS_TARGET in hlo
    fused, reference = _both_pos(qkv, bias, pos, float(d) ** -0.5)
    np.testing.assert_allclose(fused, reference, atol=2e-5, rtol=2e-5)
    zero, plain = _both_pos(qkv, bias, jnp.zeros_like(pos), float(d) ** -0.5)[0], _both(qkv, bias, float(d) ** -0.5)[0]
    np.testing.assert_allclose(zero, plain, atol=1e-6, rtol=1e-6)


def test_position_bias_as_accurate_as_the_xla_form():
    """Against float64 with a position bias of tens of nats (a sharp softmax whose max comes
    from the bias, not the scores): the kernel's error is no larger than XLA's own."""
    qkv, bias = _packed(3, 64, 2, 32, amp=2.0)
    pos = _pos_bias(2, 64, amp=20.0)
    fused, reference = _both_pos(qkv, bias, pos, 0.2)
    x = np.asarray(qkv, np.float64)
    scores = (np.einsum("bqhd,bkhd->bhqk", x[:, :, 0] * np.float32(0.2), x[:, :, 1])
              + np.asarray(bias)[:, None, None] + np.asarray(pos, np.float64)[None])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    truth = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), x[:, :, 2])
    assert np.isfinite(np.asarray(fused)).all()
    err_fused = np.abs(np.asarray(fused)[:-1] - truth[:-1]).max()
    err_xla = np.abs(np.asarray(reference)[:-1] - truth[:-1]).max()
    assert err_fused <= 2 * err_xla + 1e-6, (err_fused, err_xla)


def test_position_bias_padded_keys_contribute_exactly_nothing():
    """With a position bias, too, a row's numbers do not depend on the padding after it."""
    qkv, _ = _packed(1, 40, 2, 16, pad_rows=False)
    pos = _pos_bias(2, 40)
    fn = jax.jit(lambda x, y, z: qkv_attention(x, y, 0.25, z))
    short = fn(qkv[:, :24], jnp.zeros((1, 24)), pos[:, :24, :24])
    bias = jnp.where(jnp.arange(40) < 24, 0.0, -1e9)[None, :]
    long = fn(qkv.at[:, 24:].multiply(1e3), bias, pos.at[:, :, 24:].set(50.0))
    np.testing.assert_allclose(long[:, :24], short, atol=1e-6, rtol=1e-6)


def test_position_bias_sixteen_lane_build_and_gradients(tmp_path):
    """The 16-lane build's position-bias target gives the same numbers; gradients (qkv, both
    biases) are the XLA form's."""
    wide = kernels.build_kernel(target="jaxserve_test_attention_pos_w16", defines={"JAXSERVE_VEC_BYTES": "64"},
                                directory=tmp_path)
    b, s, h, d = 2, 70, 3, 24
    qkv, bias = _packed(b, s, h, d, seed=3)
    pos = _pos_bias(h, s)
    call = jax.ffi.ffi_call(wide.pos_bias_target, jax.ShapeDtypeStruct((b, s, h, d), jnp.float32))
    out = jax.jit(lambda x, y, z: call(x, y, z, scale=np.float32(0.125)))(qkv, bias, pos)
    fused, reference = _both_pos(qkv, bias, pos, 0.125)
    np.testing.assert_allclose(out, fused, atol=2e-6, rtol=1e-6)

    qkv, bias = _packed(2, 20, 2, 16, pad_rows=False)
    pos = _pos_bias(2, 20)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((2, 20, 2, 16)), jnp.float32)

    def loss(x, y, z):
        return (qkv_attention(x, y, 0.25, z) * w).sum()

    g_fused = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qkv, bias, pos)
    with kernels.xla_attention():
        g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qkv, bias, pos)
    for a, r in zip(g_fused, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)
