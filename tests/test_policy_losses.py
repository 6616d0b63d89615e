"""Policy losses against NumPy references, hand values and finite-difference gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives import policy as P

ppo_clip = jax.jit(P.ppo_clip, static_argnames="importance")
cispo = jax.jit(P.cispo)
reinforce = jax.jit(P.reinforce)
tis = jax.jit(P.truncated_importance_weight)

N, T = 4, 6


def make_batch(seed=0, per_sequence_adv=False):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, size=(N, T))
    logp = old + rng.normal(0.0, 0.6, size=(N, T))  # ratios spread across the clip boundaries
    adv = rng.normal(size=(N,)) if per_sequence_adv else rng.normal(size=(N, T))
    if (
        not per_sequence_adv
    ):  # put tokens in every region: delta + dual, delta only, unclipped, high, low
        forced = [
            ((0, 0), 2.5, -0.7),
            ((0, 1), 1.7, -0.5),
            ((1, 0), 0.4, 0.8),
            ((1, 1), 1.5, 0.6),
            ((2, 0), 0.5, -1.0),
        ]
        for (i, t), r, a in forced:
            logp[i, t], adv[i, t] = old[i, t] + np.log(r), a
    lengths = np.array([T, 3, 5, 1])
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[0, 2] = False  # an interior hole
    return logp, old, adv, mask


# ---------------------------------------------------------------- numpy references


def ppo_ref(logp, old, adv, mask, el=0.2, eh=0.2, delta=None, c=None, importance="token"):
    adv = np.broadcast_to(adv[:, None], logp.shape) if adv.ndim == 1 else adv
    d = logp - old
    if importance == "sequence":
        seq = np.array([d[i][mask[i]].mean() for i in range(len(d))])
        d = np.repeat(seq[:, None], d.shape[1], axis=1)
    r = np.exp(d)
    unclipped = r if delta is None else np.minimum(r, delta)
    loss = np.maximum(-adv * unclipped, -adv * np.clip(r, 1 - el, 1 + eh))
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -adv * c), loss)
    tok = logp - old
    mean = lambda x: x[mask].mean()  # noqa: E731
    metrics = {
        "clip_frac_low": mean(((adv < 0) & (r < 1 - el)).astype(float)),
        "clip_frac_high": mean(((adv > 0) & (r > 1 + eh)).astype(float)),
        "clip_frac_dual": mean(((adv < 0) & (r > c)).astype(float)) if c is not None else 0.0,
        "ratio_mean": mean(r),
        "ratio_min": r[mask].min(),
        "ratio_max": r[mask].max(),
        "approx_kl": mean(0.5 * tok**2),
        "ppo_kl": mean(-tok),
    }
    return np.where(mask, loss, 0.0), metrics


def fd_grad(f, x, h=1e-6):
    """Central differences of a scalar float64 function."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (float(f(x + e)) - float(f(x - e))) / (2 * h)
    return g


CONFIGS = {
    "ppo": dict(),
    "dapo_two_sided": dict(epsilon_low=0.2, epsilon_high=0.28, delta=1.6),
    "dual_clip": dict(clip_ratio_c=1.8),
    "gspo": dict(epsilon_low=0.1, epsilon_high=0.15, importance="sequence"),
}


# ---------------------------------------------------------------- ppo_clip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ppo_clip_matches_reference(name):
    cfg = CONFIGS[name]
    logp, old, adv, mask = make_batch(1, per_sequence_adv=name == "gspo")
    lp, o, a = (jnp.asarray(x, jnp.float32) for x in (logp, old, adv))
    loss, metrics = ppo_clip(lp, o, a, mask, **cfg)
    chex.assert_shape(loss, (N, T))
    names = {"epsilon_low": "el", "epsilon_high": "eh", "clip_ratio_c": "c"}
    ref_loss, ref_metrics = ppo_ref(
        logp, old, adv, mask, **{names.get(k, k): v for k, v in cfg.items()}
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_dual_clip_hand_value():
    one = jnp.ones((1, 1), bool)
    loss, m = ppo_clip(
        jnp.log(jnp.full((1, 1), 4.0)), jnp.zeros((1, 1)), jnp.array([-1.0]), one, clip_ratio_c=3.0
    )
    np.testing.assert_allclose(loss, [[3.0]], rtol=1e-6)
    assert float(m["clip_frac_dual"]) == 1.0


def test_ppo_gradient_wrt_ratio_hand_values():
    # A = -1: loss = max(r, clip(r, 0.8, 1.2)); dL/dr = 1 at r = 2 (unclipped), 0 at r = 0.5 (clipped).
    def loss_of_ratio(r):
        return ppo_clip(jnp.log(r), jnp.zeros((1, 1)), jnp.array([-1.0]), jnp.ones((1, 1), bool))[
            0
        ].sum()

    grad = jax.jit(jax.grad(loss_of_ratio))
    np.testing.assert_allclose(grad(jnp.full((1, 1), 2.0)), [[1.0]], rtol=1e-6)
    np.testing.assert_allclose(grad(jnp.full((1, 1), 0.5)), [[0.0]], atol=1e-12)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ppo_clip_finite_differences(name):
    cfg = CONFIGS[name]
    with jax.enable_x64(True):
        logp, old, adv, mask = make_batch(2, per_sequence_adv=name == "gspo")
        if (
            name == "gspo"
        ):  # GSPO's token form has the sequence objective's gradient under seq-mean-token-mean
            weights = mask / mask.sum(1, keepdims=True)
        else:
            weights = np.random.default_rng(3).uniform(0.5, 1.5, size=(N, T))

        @jax.jit
        def objective(x):
            return jnp.sum(weights * P.ppo_clip(x, old, adv, mask, **cfg)[0])

        g = jax.grad(objective)(jnp.asarray(logp))
        assert g.dtype == jnp.float64
        np.testing.assert_allclose(g, fd_grad(objective, logp), rtol=1e-5, atol=1e-7)
        assert np.all(np.asarray(g)[~mask] == 0)


def test_ppo_clip_bfloat16_and_padding():
    logp, old, adv, mask = make_batch(4)
    lo16, old16 = jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16)
    loss16, _ = ppo_clip(lo16, old16, jnp.asarray(adv, jnp.float32), mask)
    loss32, _ = ppo_clip(
        lo16.astype(jnp.float32), old16.astype(jnp.float32), jnp.asarray(adv, jnp.float32), mask
    )
    assert loss16.dtype == jnp.float32 and not np.isnan(np.asarray(loss16)).any()
    np.testing.assert_allclose(loss16, loss32, rtol=1e-6, atol=1e-6)
    # padding holding -inf / NaN leaks into neither the loss nor the gradient
    bad = jnp.asarray(np.where(mask, logp, -np.inf), jnp.float32)
    old_bad = jnp.asarray(np.where(mask, old, np.nan), jnp.float32)
    a = jnp.asarray(adv, jnp.float32)
    grad = jax.jit(
        jax.grad(lambda x: ppo_clip(x, old_bad, a, mask, importance="sequence")[0].sum())
    )(bad)
    assert np.isfinite(np.asarray(grad)).all()
    assert np.isfinite(np.asarray(ppo_clip(bad, old_bad, a, mask)[0])).all()


def test_ppo_clip_errors():
    logp, old, adv, mask = (jnp.asarray(x) for x in make_batch(0))
    with pytest.raises(ValueError, match="token, sequence"):
        ppo_clip(logp, old, adv, mask, importance="seq")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        P.ppo_clip(logp, old, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(AssertionError, match="old_logp"):
        ppo_clip(logp, old[:, :-1], adv, mask)
    with pytest.raises(AssertionError, match="advantages"):
        ppo_clip(logp, old, adv[:, :-1], mask)
    with pytest.raises(AssertionError, match="advantages"):
        ppo_clip(logp, old, jnp.zeros(N + 1), mask)


# ---------------------------------------------------------------- cispo, reinforce, TIS


def test_cispo_value_and_gradient():
    logp, old, adv, mask = make_batch(5)
    el, eh = 1.0, 0.1
    lp, o, a = (jnp.asarray(x, jnp.float32) for x in (logp, old, adv))
    loss, metrics = cispo(lp, o, a, mask, epsilon_low=el, epsilon_high=eh)
    w = np.clip(np.exp(logp - old), 1 - el, 1 + eh)
    np.testing.assert_allclose(loss, np.where(mask, -w * adv * logp, 0), rtol=1e-5, atol=1e-6)
    r = np.exp(logp - old)
    np.testing.assert_allclose(metrics["clip_frac_high"], (r > 1 + eh)[mask].mean(), rtol=1e-6)
    assert float(metrics["clip_frac_low"]) == 0.0
    # The weight is detached, so the gradient is -w A (not the derivative of the value).
    g = jax.jit(jax.grad(lambda x: cispo(x, o, a, mask, epsilon_low=el, epsilon_high=eh)[0].sum()))(
        lp
    )
    np.testing.assert_allclose(g, np.where(mask, -w * adv, 0), rtol=1e-5, atol=1e-6)


def test_cispo_finite_differences():
    # Moving logp and old_logp together keeps the ratio (hence the detached weight) fixed, so
    # the value's derivative along that direction is exactly the gradient d loss / d logp.
    with jax.enable_x64(True):
        logp, old, adv, mask = make_batch(6)
        shift = logp - old

        @jax.jit
        def objective(x):
            return jnp.sum(P.cispo(x, x - shift, adv, mask, epsilon_low=0.5, epsilon_high=0.2)[0])

        g = jax.grad(
            lambda x: jnp.sum(P.cispo(x, old, adv, mask, epsilon_low=0.5, epsilon_high=0.2)[0])
        )(jnp.asarray(logp))
        np.testing.assert_allclose(g, fd_grad(objective, logp), rtol=1e-5, atol=1e-7)


def test_reinforce_value_and_finite_differences():
    logp, _, adv, mask = make_batch(7, per_sequence_adv=True)
    loss, metrics = reinforce(jnp.asarray(logp, jnp.float32), jnp.asarray(adv, jnp.float32), mask)
    assert metrics == {}
    np.testing.assert_allclose(loss, np.where(mask, -adv[:, None] * logp, 0), rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):
        objective = jax.jit(lambda x: jnp.sum(P.reinforce(x, adv, mask)[0] * np.arange(1.0, T + 1)))
        np.testing.assert_allclose(
            jax.grad(objective)(jnp.asarray(logp)), fd_grad(objective, logp), rtol=1e-6, atol=1e-8
        )
    # on-policy (r = 1), PPO's gradient equals REINFORCE's
    lp = jnp.asarray(logp, jnp.float32)
    a = jnp.asarray(adv, jnp.float32)
    g_ppo = jax.grad(lambda x: ppo_clip(x, jax.lax.stop_gradient(x), a, mask)[0].sum())(lp)
    g_rf = jax.grad(lambda x: reinforce(x, a, mask)[0].sum())(lp)
    np.testing.assert_allclose(g_ppo, g_rf, rtol=1e-6, atol=1e-7)


def test_truncated_importance_weight():
    logp, old, _, mask = make_batch(8)
    sampler = old + np.random.default_rng(9).normal(0, 0.5, size=old.shape)
    o, s = jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32)
    w = tis(o, s, mask, cap=1.5)
    chex.assert_shape(w, (N, T))
    np.testing.assert_allclose(
        w, np.where(mask, np.minimum(np.exp(old - sampler), 1.5), 0), rtol=1e-5
    )
    assert np.all(np.asarray(jax.grad(lambda x: tis(x, s, mask, cap=1.5).sum())(o)) == 0)
    huge = tis(jnp.full((1, 1), 500.0), jnp.zeros((1, 1)), jnp.ones((1, 1), bool), cap=2.0)
    np.testing.assert_allclose(huge, [[2.0]])
    with pytest.raises(ValueError, match="cap"):
        P.truncated_importance_weight(o, s, mask, cap=0.0)
    with pytest.raises(AssertionError, match="sampler_logp"):
        tis(o, s[:, :-1], mask, cap=2.0)


def test_losses_bfloat16():
    logp, old, adv, mask = make_batch(10)
    lp16, old16 = jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16)
    a = jnp.asarray(adv, jnp.float32)
    for fn in (functools.partial(cispo, epsilon_low=1.0, epsilon_high=0.3),):
        lo, hi = (
            fn(lp16, old16, a, mask)[0],
            fn(lp16.astype(jnp.float32), old16.astype(jnp.float32), a, mask)[0],
        )
        assert not np.isnan(np.asarray(lo)).any()
        np.testing.assert_allclose(lo, hi, rtol=1e-6, atol=1e-6)
    lo = reinforce(lp16, a, mask)[0]
    np.testing.assert_allclose(lo, reinforce(lp16.astype(jnp.float32), a, mask)[0], rtol=1e-6)
