"""Multi-head attention core shared by BERT and ViT: softmax(q kᵀ + key_bias) v.

Laid out for XLA:CPU, where attention (not the dense layers) is what falls behind at
long sequences (per-thunk profile: ``python -m bench.peer --profile minilm:8x256``):

- Scores are [B, H, key, query], so the softmax reduces over a non-minor axis,
  vectorised across queries. With the usual [B, H, query, key] every row is a
  32..256-wide minor-axis reduce, and XLA:CPU's fusion took ~3x longer at S=256
  (attention alone, ViT's former textbook form included: 10-35% slower at 8-32 × 128-256).
- The softmax's division comes after the PV matmul: a divide over [B, S, H, dh] instead
  of a multiply over [B, H, S, S] (the same division, moved).

Tried and dropped (measured): running the batch rows one at a time (``lax.map``) once
the batch's scores outgrow the cache. On attention alone it cut 26-53% at 32×128,
32×256 and 4-8×512, but inside the whole encoder (MiniLM 8×256, 32×128, 32×256;
BERT-base 32×128, 32×256) it changed nothing (0.99-1.02×), so the simpler form stays.
Re-measured with per-cell YNN options, whole MiniLM encoder, time ratio to this form (>1:
faster) at 32×256 / 8×256 / 32×128: [B,H,q,k] scores with the PV dot in its fastest layout
(116 vs 51 GFLOP/s alone) 0.89 / 1.11 / 0.91; ``jax.nn.dot_product_attention`` (xla) 0.80 /
0.85 / -; blocks of 4-24 (batch, head) pairs under ``lax.map`` 0.98-1.03 / 0.98-1.11 /
0.85-0.90; the softmax denominator as an extra ones column of V 1.03 / 0.95 / -; bf16 q, k,
v and probabilities (bf16 mode) 0.93-1.06; no max pass at all (2026-11-23): the exponent
shifted by a per-query lower bound of the max, q·(mean of the unmasked keys) + 30, which
keeps the max term >= e^-30 and cannot lose a term that matters (a real version would need a
finiteness check and an exact fallback), 1.09 / 0.96 / 1.02, and 0.96 at 8×64, before that
check's cost: not worth a second code path. What XLA:CPU cannot do is keep the [B,H,S,S]
scores in cache: PyTorch's fused SDPA kernel runs one MiniLM 32×256 layer's attention in
23 ms, this form ~70 ms (the dots alone ~40 ms, at 41-77 GFLOP/s).

Hence :func:`qkv_attention`'s fused CPU kernel (``jaxserve/kernels/attention_cpu.cc``),
which finishes each (batch, head, query block) while its scores sit in cache. Attention
alone, 2-core Zen 3, time of this form / the kernel's: 1.5 at MiniLM 8×128, 2.7 at 32×256;
1.8 / 3.0 / 3.4 at BERT-base 8×128 / 32×128 / 32×256 (the kernel at 38-71 GFLOP/s, this
form at 18-29). This form stays as the fallback, the gradient and the reference the
kernel is tested against.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import kernels

__all__ = ["attention", "qkv_attention"]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array | None = None) -> jax.Array:
    """q, k, v: [B, S, H, dh] (q already scaled); key_bias: [B, S] added to every query's
    score for that key (padding mask, ToMe's log-size), or None. Returns [B, S, H, dh]."""
    scores = jnp.einsum("bkhd,bqhd->bhkq", k, q)
    if key_bias is not None:
        scores = scores + key_bias[:, None, :, None]
    e = jnp.exp(scores - scores.max(axis=2, keepdims=True))
    denom = jnp.transpose(e.sum(axis=2), (0, 2, 1))[..., None]  # [B, query, H, 1]
    return jnp.einsum("bhkq,bkhd->bqhd", e, v) / denom


def qkv_attention(qkv: jax.Array, key_bias: jax.Array | None, scale: float) -> jax.Array:
    """Attention from the packed projection qkv [B, S, 3, H, dh] (q, k, v along axis 2, as
    BERT's and timm's QKV linears write them), q scaled by ``scale``. Returns [B, S, H, dh].

    On the CPU with the fused kernel available (jaxserve.kernels) this is one FFI call that
    reads qkv in place; otherwise, or inside ``kernels.xla_attention()``, the XLA form
    above. Gradients always come from the XLA form (the kernel is forward-only; training
    prompts differentiates through here)."""
    if qkv.dtype != jnp.float32 or kernels.attention_impl() != "fused":
        return _xla_qkv_attention(qkv, key_bias, scale)
    if key_bias is None:
        key_bias = jnp.zeros(qkv.shape[:2], jnp.float32)
    return _fused(qkv, key_bias.astype(jnp.float32), float(scale))


def _xla_qkv_attention(qkv, key_bias, scale):
    return attention(qkv[:, :, 0] * scale, qkv[:, :, 1], qkv[:, :, 2], key_bias)


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
