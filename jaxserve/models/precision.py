"""Matmul precision of a servable: float32 (the default) or bfloat16 weights.

``precision="bf16"`` stores every dense layer's kernel as bfloat16 and feeds the layer's
input to the matmul as bfloat16, accumulating and returning float32. Everything else stays
float32: embeddings, biases, LayerNorm, softmax, the attention matmuls (bf16 scores and
probabilities measured no faster) and the pooled output. It is the CPU counterpart of TF32
on a GPU: on a CPU with AMX / AVX512-BF16, XLA hands bf16 x bf16 -> f32 dots to YNNPACK,
which runs them several times faster than float32. Sentence embeddings keep cosine >= 0.9999
to the float32 ones (tests/integration/test_precision.py). A CPU without bf16 dot units runs
these dots slower than float32: the mode is opt-in (``jaxserve warmup/serve --precision
bf16``), never the default (measurements: bench/RESULTS.md, 'The measurements behind the
code's rules').

Decision: the weights carry the precision. The kernels are cast once, when a runtime loads
(:func:`matmul_weights`), so the executable takes bf16 kernels as arguments: no per-call
cast, and the argument dtypes are part of the compile-cache key, so a float32 executable
can never be handed bf16 weights or the reverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_KERNEL_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
PRECISIONS = tuple(_KERNEL_DTYPES)


class Dense(nnx.Linear):
    """``nnx.Linear`` whose matmul runs in its kernel's dtype and accumulates in float32.

    With a float32 kernel this is nnx.Linear's computation (same dot, same result); with a
    bfloat16 kernel the input is rounded to bfloat16 for the dot only. Parameters are the same
    ``kernel`` / ``bias`` as nnx.Linear's, so checkpoints import unchanged.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = jnp.dot(x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def _is_dense_kernel(path: tuple, value) -> bool:
    return bool(path) and str(path[-1]) == "kernel" and len(getattr(value, "shape", ())) == 2


def matmul_weights(state, precision: str):
    """``state`` (an ``nnx.split`` weights pytree, concrete or abstract) with every dense
    kernel in ``precision``'s dtype; other leaves untouched. f32 returns ``state`` itself."""
    if precision not in _KERNEL_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision == "f32":
        return state
    dtype = _KERNEL_DTYPES[precision]

    def cast(value):
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape, dtype)
        return jax.device_put(np.asarray(value).astype(dtype))  # cast on the host: nothing to compile

    flat = [(path, v.replace(cast(v.get_value())) if _is_dense_kernel(path, v.get_value()) else v)
            for path, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def kernel_dtypes(state) -> dict[str, np.dtype]:
    """dtype per parameter path, for reports and tests."""
    return {"/".join(str(k) for k in path): np.dtype(v.get_value().dtype) for path, v in nnx.to_flat_state(state)}
