"""A 2-D matmul whose weight gradient XLA:CPU computes from a materialised ``x^T``.

Autodiff writes the weight gradient of ``y = x W`` as ``dW = x^T dy`` with both operands
contracted on their major axis. XLA:CPU runs that form slower than the product of a transposed
copy of ``x`` with ``dy`` (2 CPU cores, float32, isolated: the LM head's
``[1024, 4096]^T [1024, 256]`` 19 ms against 12.6 ms; ``[1024, 256]^T [1024, 688]`` 2.25 ms against
2.04 ms from a pre-transposed ``x``, a margin the transpose itself can eat when nothing shares it).
In the GRPO update, where q/k/v and gate/up share their input's transpose, it is faster overall
(update segment 2.15 -> 2.11 s, ``benchmarks/RESULTS.md``). So on CPU the weight gradient
transposes ``x`` first, behind an ``optimization_barrier`` that keeps XLA from folding the
transpose back into the product; on other backends it is the plain product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.passes import current_backend


def weight_grad(
    x: Float[Array, "n i"], dy: Float[Array, "n o"], *, out_dtype=None, transpose: bool = False
) -> Float[Array, "i o"] | Float[Array, "o i"]:
    """``x^T dy`` (accumulated in ``out_dtype`` when given), from a materialised ``x^T`` on CPU.
    ``transpose``: return ``dy^T x`` instead, on CPU as ``(x^T dy)^T`` with the product kept behind
    a barrier too (the LM head's ``dW = dz^T h`` with ``x = h``: a transposed copy of ``dz``, the
    vocabulary-sized operand, would cost more than the product saves)."""
    if current_backend() != "cpu":
        return jnp.einsum(
            "ni,no->oi" if transpose else "ni,no->io", x, dy, preferred_element_type=out_dtype
        )
    barrier = jax.lax.optimization_barrier
    out = jnp.dot(barrier(x.T), dy, preferred_element_type=out_dtype)
    return barrier(out).T if transpose else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_cpu(x, w, out_dtype):
    return jnp.dot(x, w, preferred_element_type=out_dtype)


def _matmul_cpu_fwd(x, w, out_dtype):
    return _matmul_cpu(x, w, out_dtype), (x, w)


def _matmul_cpu_bwd(out_dtype, res, dy):
    x, w = res
    dy = dy.astype(x.dtype)  # the cotangent in the operands' dtype, as autodiff of ``jnp.dot``
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    return dx, weight_grad(x, dy, out_dtype=jnp.float32).astype(w.dtype)


_matmul_cpu.defvjp(_matmul_cpu_fwd, _matmul_cpu_bwd)


def matmul(x: Float[Array, "n i"], w: Float[Array, "i o"], out_dtype=None) -> Float[Array, "n o"]:
    """``x w`` accumulated in float32, the result in ``out_dtype`` (None: the operands' dtype); on
    CPU a ``custom_vjp`` whose weight gradient is ``weight_grad`` (reverse mode only there:
    forward-mode autodiff of a CPU trace raises), elsewhere ``jnp.dot``. Gradients come back in the
    operands' dtypes."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if current_backend() != "cpu":
        return jnp.dot(x, w, preferred_element_type=out_dtype)
    return _matmul_cpu(x, w, jnp.dtype(out_dtype))
