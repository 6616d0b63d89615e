import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.masked import (
    masked_count,
    masked_mean,
    masked_std,
    masked_sum,
    masked_var,
    masked_whiten,
)

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 6)).astype(np.float32)
M = RNG.random((4, 6)) > 0.4
M[0] = False  # one fully padded row
M[1] = [True] + [False] * 5  # one single-token row


def np_masked(x, m, axis):
    """Plain numpy references, row by row / over everything."""
    if axis is None:
        vals = [x[m]]
    else:
        vals = [x[i][m[i]] for i in range(x.shape[0])]
    out = {"sum": [], "mean": [], "var_u": [], "var_b": []}
    for v in vals:
        n = len(v)
        out["sum"].append(v.sum())
        out["mean"].append(v.mean() if n else 0.0)
        mu = v.mean() if n else 0.0
        ss = ((v - mu) ** 2).sum()
        out["var_u"].append(ss / max(n - 1, 1))
        out["var_b"].append(ss / max(n, 1))
    return {k: np.asarray(v if axis is not None else v[0]) for k, v in out.items()}


@pytest.mark.parametrize("axis", [None, -1])
def test_against_numpy(axis):
    ref = np_masked(X, M, axis)
    np.testing.assert_allclose(masked_sum(X, M, axis), ref["sum"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(masked_mean(X, M, axis), ref["mean"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(masked_var(X, M, axis), ref["var_u"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        masked_var(X, M, axis, unbiased=False), ref["var_b"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(masked_std(X, M, axis), np.sqrt(ref["var_u"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(masked_count(M, axis), M.sum(axis=axis))


def test_hand_values_and_padding_ignored():
    x = jnp.array([[1.0, 2.0, 3.0, jnp.nan], [jnp.inf, 5.0, 7.0, 0.0]])
    m = jnp.array([[1, 1, 1, 0], [0, 1, 1, 0]], bool)
    assert float(masked_sum(x, m)) == 18.0
    assert float(masked_mean(x, m)) == pytest.approx(18.0 / 5)
    np.testing.assert_allclose(masked_mean(x, m, axis=1), [2.0, 6.0])
    np.testing.assert_allclose(masked_var(x, m, axis=1), [1.0, 2.0])  # (1+0+1)/2, (1+1)/1
    np.testing.assert_allclose(masked_var(x, m, axis=1, unbiased=False), [2 / 3, 1.0], rtol=1e-6)
    assert float(masked_mean(x, jnp.zeros_like(m))) == 0.0
    g = jax.grad(lambda x: masked_var(x, m))(x)  # NaN/inf padding does not leak into gradients
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~np.asarray(m)] == 0)


def test_whiten():
    w = masked_whiten(X, M)
    v = X[M]
    ref = (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(w)[M], ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(w)[~M] == 0)
    w2 = masked_whiten(X, M, shift_mean=False)
    np.testing.assert_allclose(np.asarray(w2)[M], ref + v.mean(), rtol=1e-5, atol=1e-6)
    # per-row statistics
    wr = np.asarray(masked_whiten(X, M, axis=-1))
    row = X[2][M[2]]
    np.testing.assert_allclose(
        wr[2][M[2]], (row - row.mean()) / np.sqrt(row.var(ddof=1) + 1e-8), rtol=1e-5
    )


def test_jit_bf16_and_grad():
    f = jax.jit(lambda x, m: masked_mean(x, m, axis=-1))
    out = f(jnp.asarray(X, jnp.bfloat16), M)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_masked(X, M, -1)["mean"], atol=2e-2)
    g = jax.grad(lambda x: masked_mean(x, M))(jnp.asarray(X))
    np.testing.assert_allclose(g, M / M.sum(), rtol=1e-6)
    g = jax.grad(lambda x: masked_mean(x, jnp.zeros_like(M)))(jnp.asarray(X))
    assert np.all(np.isfinite(g))


def test_shape_mismatch_names_arrays():
    with pytest.raises(AssertionError, match=r"x=\(4, 6\).*mask=\(4, 5\)"):
        masked_mean(X, M[:, :5])
