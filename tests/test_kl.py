"""KL estimators, entropy and the KL / entropy terms against NumPy and hand values."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives import kl as K

kl_estimate = jax.jit(K.kl_estimate, static_argnames="kind")
entropy_from_logits = jax.jit(K.entropy_from_logits)


def kl_ref(logp, ref, kind):
    d = logp - ref
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    if kind == "abs":
        return np.abs(d)
    if kind == "k3":
        return np.exp(-d) + d - 1
    x = np.clip(-d, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def entropy_ref(logits):
    out = np.zeros(logits.shape[:-1])
    for idx in np.ndindex(out.shape):
        z = logits[idx].astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        out[idx] = -sum(pi * np.log(pi) for pi in p if pi > 0)
    return out


def batch(seed=0):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 1.0, size=(3, 5))
    ref = logp + rng.normal(0.0, 0.7, size=(3, 5))
    mask = np.arange(5)[None, :] < np.array([[5], [2], [4]])
    return logp, ref, mask


ALL_KINDS = [*K.KL_ESTIMATORS, "kl", "mse"]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_kl_matches_reference(kind):
    logp, ref, _ = batch()
    got = kl_estimate(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32), kind)
    chex.assert_shape(got, logp.shape)
    np.testing.assert_allclose(got, kl_ref(logp, ref, kind), rtol=1e-5, atol=1e-6)


def test_kl_hand_values_and_clamps():
    np.testing.assert_allclose(
        kl_estimate(jnp.array(0.5), jnp.array(0.0), "k3"), 0.1065307, rtol=1e-6
    )
    np.testing.assert_allclose(
        kl_estimate(jnp.array(0.5), jnp.array(0.0), "low_var_kl"), 0.1065307, rtol=1e-6
    )
    # ref - logp = 30: verl's low_var_kl clamps the log-ratio to 20 and the result to 10; k3 does not.
    far = (jnp.array(-30.0), jnp.array(0.0))
    np.testing.assert_allclose(kl_estimate(*far, "low_var_kl"), 10.0)
    np.testing.assert_allclose(kl_estimate(*far, "k3"), np.exp(30.0) - 31.0, rtol=1e-5)


def test_k3_keeps_its_square_near_zero():
    # Policy and reference a hair apart (logp values of a few units, differing in the last bits):
    # float32 exp(-d) + d - 1 rounds d^2 / 2 away or below 0; the float64 series is the reference.
    logp = np.float32(-3.0) + np.array([0.0, 1e-6, -1e-6, 3e-5, -3e-5, 1e-3], np.float32)
    ref = np.full_like(logp, -3.0)
    d = logp.astype(np.float64) - ref.astype(np.float64)
    want = np.expm1(-d) + d
    got = np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(ref), "k3"))
    assert (got >= 0).all(), got
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-15)


def test_kl_mask_and_padding():
    logp, ref, mask = batch(1)
    bad = jnp.asarray(np.where(mask, logp, -np.inf), jnp.float32)
    r = jnp.asarray(ref, jnp.float32)
    for kind in K.KL_ESTIMATORS:
        got = kl_estimate(bad, r, kind, mask=mask)
        np.testing.assert_allclose(
            got, np.where(mask, kl_ref(logp, ref, kind), 0), rtol=1e-5, atol=1e-6
        )
        g = jax.grad(lambda x, kind=kind: kl_estimate(x, r, kind, mask=mask).sum())(bad)
        assert np.isfinite(np.asarray(g)).all()


def test_kl_finite_differences():
    with jax.enable_x64(True):
        logp, ref, mask = batch(2)
        for kind in ["k1", "k2", "k3", "abs", "low_var_kl"]:
            f = jax.jit(lambda x, kind=kind: K.kl_estimate(x, ref, kind, mask=mask).sum())
            h = 1e-6
            fd = np.zeros_like(logp)
            for idx in np.ndindex(logp.shape):
                e = np.zeros_like(logp)
                e[idx] = h
                fd[idx] = (f(logp + e) - f(logp - e)) / (2 * h)
            np.testing.assert_allclose(jax.grad(f)(logp), fd, rtol=1e-5, atol=1e-8, err_msg=kind)


def test_kl_bfloat16():
    logp, ref, _ = batch(3)
    lo16, ref16 = jnp.asarray(logp, jnp.bfloat16), jnp.asarray(ref, jnp.bfloat16)
    for kind in ["k3", "low_var_kl"]:
        lo = kl_estimate(lo16, ref16, kind)
        assert lo.dtype == jnp.float32 and not np.isnan(np.asarray(lo)).any()
        np.testing.assert_allclose(
            lo, kl_estimate(lo16.astype(jnp.float32), ref16.astype(jnp.float32), kind), rtol=1e-6
        )


def test_kl_errors():
    with pytest.raises(ValueError, match="k1, k2, k3, abs, low_var_kl"):
        K.kl_estimate(jnp.zeros(3), jnp.zeros(3), "k4")
    with pytest.raises(AssertionError, match="ref_logp"):
        kl_estimate(jnp.zeros((2, 3)), jnp.zeros((2, 4)), "k3")


def test_entropy_from_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, size=(2, 3, 11))
    got = entropy_from_logits(jnp.asarray(logits, jnp.float32))
    chex.assert_shape(got, (2, 3))
    np.testing.assert_allclose(got, entropy_ref(logits), rtol=1e-5, atol=1e-6)
    # uniform -> log V; huge logits stay finite; -inf logits contribute 0 with finite gradients
    np.testing.assert_allclose(entropy_from_logits(jnp.zeros((1, 11))), [np.log(11)], rtol=1e-6)
    big = jnp.asarray(logits * 1e4, jnp.float32)
    assert np.isfinite(np.asarray(entropy_from_logits(big))).all()
    masked = jnp.asarray(logits, jnp.float32).at[..., :4].set(-jnp.inf)
    np.testing.assert_allclose(
        entropy_from_logits(masked), entropy_ref(logits[..., 4:]), rtol=1e-5, atol=1e-6
    )
    g = jax.grad(lambda z: entropy_from_logits(z).sum())(masked)
    assert np.isfinite(np.asarray(g)).all()
    # bfloat16 logits: float32 result close to the float32 computation on the same values
    lo = entropy_from_logits(jnp.asarray(logits, jnp.bfloat16))
    assert lo.dtype == jnp.float32
    np.testing.assert_allclose(
        lo, entropy_from_logits(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)), rtol=1e-6
    )


def test_entropy_finite_differences():
    with jax.enable_x64(True):
        z = np.random.default_rng(5).normal(size=(2, 6))
        f = jax.jit(lambda x: K.entropy_from_logits(x).sum())
        h = 1e-6
        fd = np.zeros_like(z)
        for idx in np.ndindex(z.shape):
            e = np.zeros_like(z)
            e[idx] = h
            fd[idx] = (f(z + e) - f(z - e)) / (2 * h)
        np.testing.assert_allclose(jax.grad(f)(z), fd, rtol=1e-5, atol=1e-8)


def test_kl_penalty_reward():
    logp, ref, mask = batch(6)
    rewards = np.zeros_like(logp)
    rewards[0, -1] = 1.0
    kl = kl_ref(logp, ref, "k1")
    got = jax.jit(K.kl_penalty_reward)(jnp.asarray(rewards), jnp.asarray(kl), mask, beta=0.1)
    np.testing.assert_allclose(got, np.where(mask, rewards - 0.1 * kl, 0), rtol=1e-5, atol=1e-7)
    with pytest.raises(AssertionError, match="kl"):
        K.kl_penalty_reward(jnp.zeros((2, 3)), jnp.zeros((2, 2)), jnp.ones((2, 3), bool), beta=0.1)


def test_conservative_penalty():
    f = jax.jit(K.conservative_penalty)
    np.testing.assert_allclose(
        f(jnp.array([0.05, 0.3]), threshold=0.1, coef=2.0), [0.0, 0.08], rtol=1e-6
    )
    with jax.enable_x64(True):
        x = np.array([0.05, 0.3, 0.7])
        penalty = jax.jit(lambda k: K.conservative_penalty(k, threshold=0.1, coef=2.0).sum())
        g = jax.grad(penalty)(x)
        h = 1e-6
        fd = [(penalty(x + h * e) - penalty(x - h * e)) / (2 * h) for e in np.eye(3)]
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(g, [0.0, 0.8, 2.4], rtol=1e-6)


def test_entropy_bonus():
    ent = np.abs(np.random.default_rng(7).normal(size=(3, 5)))
    _, _, mask = batch()
    got = jax.jit(K.entropy_bonus)(jnp.asarray(ent, jnp.bfloat16), mask, coef=0.01)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.where(mask, -0.01 * ent, 0), rtol=1e-2, atol=1e-5)
    g = jax.grad(lambda e: K.entropy_bonus(e, mask, coef=0.01).sum())(jnp.asarray(ent))
    np.testing.assert_allclose(g, np.where(mask, -0.01, 0), rtol=1e-6)
    with pytest.raises(AssertionError, match="entropy"):
        K.entropy_bonus(jnp.zeros((3, 4)), mask, coef=0.01)
