"""``relax.models.layers.matmul``: the CPU matmul's custom gradient against numpy closed forms."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models.layers.matmul import matmul, weight_grad


@pytest.mark.parametrize("shape", [(7, 5, 3), (64, 32, 48)])
def test_matmul_value_and_gradients_match_numpy(shape):
    """``y = x w``, ``L = sum(c * y)``: ``dL/dx = c w^T``, ``dL/dw = x^T c`` (float64 numpy)."""
    n, i, o = shape
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x, w, c = (jax.random.normal(k, s) for k, s in ((kx, (n, i)), (kw, (i, o)), (kc, (n, o))))
    y = jax.jit(matmul)(x, w)
    chex.assert_shape(y, (n, o))
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, c))
    np.testing.assert_allclose(y, x64 @ w64, rtol=1e-5, atol=1e-5)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(c * matmul(x, w)), argnums=(0, 1)))(x, w)
    chex.assert_shape((dx, dw), ((n, i), (i, o)))
    np.testing.assert_allclose(dx, c64 @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x64.T @ c64, rtol=1e-5, atol=1e-5)


def test_matmul_under_vmap_and_scan():
    """The custom gradient batches (vmap) and sits in a scanned loop like ``jnp.dot``."""
    kx, kw = jax.random.split(jax.random.key(1))
    x, w = jax.random.normal(kx, (3, 6, 4)), jax.random.normal(kw, (4, 5))

    def loss(w, fn):
        per = jax.vmap(lambda xi: jnp.sum(jnp.sin(fn(xi, w))))(x)
        return jax.lax.scan(lambda acc, v: (acc + v, None), 0.0, per)[0]

    got = jax.grad(loss)(w, matmul)
    want = jax.grad(loss)(w, jnp.dot)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_weight_grad_accumulates_bfloat16_in_float32():
    kx, kd = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (256, 8)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (256, 4)).astype(jnp.bfloat16)
    got = jax.jit(lambda a, b: weight_grad(a, b, out_dtype=jnp.float32))(x, dy)
    assert got.dtype == jnp.float32
    want = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
