"""Multi-head attention core shared by BERT and ViT: softmax(q kᵀ + key_bias) v.

Laid out for XLA:CPU, where attention (not the dense layers) is what falls behind at
long sequences (per-thunk profile: ``python -m bench.peer --profile minilm:8x256``):

- Scores are [B, H, key, query], so the softmax reduces over a non-minor axis,
  vectorised across queries; with the usual [B, H, query, key] every row is a narrow
  minor-axis reduce, which XLA:CPU's fusion runs several times slower.
- The softmax's division comes after the PV matmul: a divide over [B, S, H, dh] instead
  of a multiply over [B, H, S, S] (the same division, moved).

Tried and dropped, none making the whole encoder faster across cells: batch rows one at a
time under ``lax.map``, [B,H,q,k] scores, ``jax.nn.dot_product_attention``, blocks of
(batch, head) pairs under ``lax.map``, the softmax denominator as a ones column of V, bf16
probabilities, no max pass. What XLA:CPU cannot do is keep the [B,H,S,S] scores in cache.
Hence :func:`qkv_attention`'s fused CPU kernel (``jaxserve/kernels/attention_cpu.cc``),
which finishes each (batch, head, query block) while its scores sit in cache, and is faster
at every cell measured. This form stays as the fallback, the gradient and the reference the
kernel is tested against (measurements: bench/RESULTS.md, 'The measurements behind the
code's rules').
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import kernels

__all__ = ["attention", "qkv_attention", "record_importance"]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array | None = None,
              pos_bias: jax.Array | None = None) -> jax.Array:
    """q, k, v: [B, S, H, dh] (q already scaled); key_bias: [B, S] added to every query's
    score for that key (padding mask, ToMe's log-size), or None; pos_bias: [H, S(query),
    S(key)] added per head to every batch row's scores (MPNet's relative positions), or None.
    Returns [B, S, H, dh]."""
    scores = jnp.einsum("bkhd,bqhd->bhkq", k, q)
    if key_bias is not None:
        scores = scores + key_bias[:, None, :, None]
    if pos_bias is not None:
        scores = scores + jnp.swapaxes(pos_bias, 1, 2)[None]
    e = jnp.exp(scores - scores.max(axis=2, keepdims=True))
    denom = jnp.transpose(e.sum(axis=2), (0, 2, 1))[..., None]  # [B, query, H, 1]
    return jnp.einsum("bhkq,bkhd->bqhd", e, v) / denom


class _Importance(threading.local):
    def __init__(self):
        self.stack: list[list] = []


_IMPORTANCE = _Importance()


@contextlib.contextmanager
def record_importance(query_mask: jax.Array):
    """While tracing inside this context (one thread's trace), every :func:`qkv_attention`
    runs the XLA form and adds its layer's importance to the yielded list: per key, the
    attention probability it receives, summed over heads and over the real query rows
    (``query_mask`` [B, S], 1 for a real token), [B, S] each. Their sum over layers is Tabi's
    importance vector (Eq. 5's I), computed inside the executable that makes the prediction,
    not by a second pass. The fused kernel does not return its probabilities, so a model
    traced with importance runs the XLA form (its servable is keyed apart: ``bert_servable``'s
    ``importance``); the prediction is the same attention, its division placed before the PV
    product instead of after."""
    layers: list = []
    _IMPORTANCE.stack.append((query_mask, layers))
    try:
        yield layers
    finally:
        _IMPORTANCE.stack.pop()


def _attention_with_importance(qkv, key_bias, scale, pos_bias, query_mask):
    q, k, v = qkv[:, :, 0] * scale, qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bkhd,bqhd->bhkq", k, q)
    if key_bias is not None:
        scores = scores + key_bias[:, None, :, None]
    if pos_bias is not None:
        scores = scores + jnp.swapaxes(pos_bias, 1, 2)[None]
    e = jnp.exp(scores - scores.max(axis=2, keepdims=True))
    p = e / e.sum(axis=2, keepdims=True)  # [B, H, key, query]: each query's distribution over keys
    importance = jnp.einsum("bhkq,bq->bk", p, query_mask.astype(p.dtype))
    return jnp.einsum("bhkq,bkhd->bqhd", p, v), importance


def qkv_attention(qkv: jax.Array, key_bias: jax.Array | None, scale: float,
                  pos_bias: jax.Array | None = None) -> jax.Array:
    """Attention from the packed projection qkv [B, S, 3, H, dh] (q, k, v along axis 2, as
    BERT's and timm's QKV linears write them), q scaled by ``scale``; ``pos_bias`` an optional
    [H, S(query), S(key)] bias shared by the batch (MPNet). Returns [B, S, H, dh].

    On the CPU with the fused kernel available (jaxserve.kernels) this is one FFI call that
    reads qkv in place (with ``pos_bias``: the kernel's position-bias target, which adds it
    in cache); otherwise, or inside ``kernels.xla_attention()``, the XLA form above.
    Without ``pos_bias`` the traced program is exactly what it was before that argument
    existed. Gradients always come from the XLA form (the kernel is forward-only; training
    prompts differentiates through here)."""
    if _IMPORTANCE.stack:  # record_importance: the XLA form, and this layer's importance
        query_mask, layers = _IMPORTANCE.stack[-1]
        ctx, importance = _attention_with_importance(qkv, key_bias, scale, pos_bias, query_mask)
        layers.append(importance)
        return ctx
    if qkv.dtype != jnp.float32 or kernels.attention_impl() != "fused":
        return _xla_qkv_attention(qkv, key_bias, scale, pos_bias)
    if key_bias is None:
        key_bias = jnp.zeros(qkv.shape[:2], jnp.float32)
    if pos_bias is None:
        return _fused(qkv, key_bias.astype(jnp.float32), float(scale))
    return _fused_pos(qkv, key_bias.astype(jnp.float32), pos_bias.astype(jnp.float32), float(scale))


def _xla_qkv_attention(qkv, key_bias, scale, pos_bias=None):
    return attention(qkv[:, :, 0] * scale, qkv[:, :, 1], qkv[:, :, 2], key_bias, pos_bias)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fused(qkv, key_bias, scale):
    b, s, _, h, d = qkv.shape
    call = jax.ffi.ffi_call(kernels.ATTENTION_TARGET, jax.ShapeDtypeStruct((b, s, h, d), jnp.float32),
                            vmap_method="sequential")
    return call(qkv, key_bias, scale=np.float32(scale))


def _fused_fwd(qkv, key_bias, scale):
    return _fused(qkv, key_bias, scale), (qkv, key_bias)


def _fused_bwd(scale, residuals, grad):
    _, pullback = jax.vjp(lambda qkv, bias: _xla_qkv_attention(qkv, bias, scale), *residuals)
    return pullback(grad)


_fused.defvjp(_fused_fwd, _fused_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_pos(qkv, key_bias, pos_bias, scale):
    b, s, _, h, d = qkv.shape
    call = jax.ffi.ffi_call(kernels.ATTENTION_POS_BIAS_TARGET, jax.ShapeDtypeStruct((b, s, h, d), jnp.float32),
                            vmap_method="sequential")
    return call(qkv, key_bias, pos_bias, scale=np.float32(scale))


def _fused_pos_fwd(qkv, key_bias, pos_bias, scale):
    return _fused_pos(qkv, key_bias, pos_bias, scale), (qkv, key_bias, pos_bias)


def _fused_pos_bwd(scale, residuals, grad):
    _, pullback = jax.vjp(lambda qkv, bias, pos: _xla_qkv_attention(qkv, bias, scale, pos), *residuals)
    return pullback(grad)


_fused_pos.defvjp(_fused_pos_fwd, _fused_pos_bwd)
