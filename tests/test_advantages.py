"""Advantage estimators against plain NumPy references and hand-computed values."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives import advantages as A


# Everything runs jitted (one compile per function and shape; eager op-by-op dispatch is slower here).
class adv:
    GRPO_SCALES = A.GRPO_SCALES
    grpo = jax.jit(A.grpo, static_argnames="scale")
    rloo = jax.jit(A.rloo)
    broadcast_to_tokens = jax.jit(A.broadcast_to_tokens)
    whiten = jax.jit(A.whiten, static_argnames="shift_mean")
    mc_returns = jax.jit(A.mc_returns)
    reinforce_pp = jax.jit(A.reinforce_pp)
    reinforce_pp_baseline = jax.jit(A.reinforce_pp_baseline)
    gae = jax.jit(A.gae)
    truncated_returns = jax.jit(A.truncated_returns, static_argnames="k")
    vineppo_advantages = jax.jit(A.vineppo_advantages)


def make_mask(rng, n, t, holes=True):
    """Right-padded rows of random length >= 1, plus (optionally) interior holes in some rows."""
    lengths = rng.integers(1, t + 1, size=n)
    mask = np.arange(t)[None, :] < lengths[:, None]
    if holes:
        for i in range(0, n, 2):
            if lengths[i] > 2:
                mask[i, rng.integers(1, lengths[i] - 1)] = False
    return mask


# ---------------------------------------------------------------- numpy references


def grpo_ref(r, scale, eps=1e-4):
    out = np.zeros_like(r)
    allv = r[~np.isnan(r)]
    batch_std = allv.std(ddof=1) if len(allv) > 1 else 0.0
    for i in range(r.shape[0]):
        v = ~np.isnan(r[i])
        vals = r[i][v]
        if len(vals) < 2 or np.all(vals == vals[0]):
            continue
        centred = vals - vals.mean()
        if scale == "none":
            out[i, v] = centred
        else:
            std = vals.std(ddof=1) if scale == "group" else batch_std
            out[i, v] = centred / (std + eps)
    return out


def rloo_ref(r):
    out = np.zeros_like(r)
    for i in range(r.shape[0]):
        idx = [j for j in range(r.shape[1]) if not np.isnan(r[i, j])]
        vals = r[i, idx]
        if len(idx) < 2 or np.all(vals == vals[0]):
            continue
        for j in idx:
            others = [r[i, k] for k in idx if k != j]
            out[i, j] = r[i, j] - np.mean(others)
    return out


def mc_ref(r, m, gamma):
    out = np.zeros_like(r)
    for i in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                g = r[i, t] + gamma * g
                out[i, t] = g
    return out


def whiten_ref(x, m):
    vals = x[m]
    var = vals.var(ddof=1) if len(vals) > 1 else 0.0
    out = np.zeros_like(x)
    out[m] = (vals - vals.mean()) / np.sqrt(var + 1e-8)
    return out


def gae_ref(r, v, m, gamma, lam):
    """verl's compute_gae_advantage_return loop, outputs zeroed at masked positions."""
    n, t_len = r.shape
    next_v, last = np.zeros(n), np.zeros(n)
    out = np.zeros_like(r)
    for t in reversed(range(t_len)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * last
        next_v = np.where(m[:, t], v[:, t], next_v)
        last = np.where(m[:, t], a, last)
        out[:, t] = np.where(m[:, t], a, 0.0)
    return out, np.where(m, out + v, 0.0)


def truncated_ref(r, v, m, gamma, k):
    out = np.zeros_like(r)
    for i in range(r.shape[0]):
        idx = np.flatnonzero(m[i])
        for j, t in enumerate(idx):
            total = sum(gamma**s * r[i, idx[j + s]] for s in range(k) if j + s < len(idx))
            if j + k < len(idx):
                total += gamma**k * v[i, idx[j + k]]
            out[i, t] = total
    return out


def vineppo_ref(v, m, terminal):
    out = np.zeros_like(v)
    for i in range(v.shape[0]):
        idx = np.flatnonzero(m[i])
        for j, t in enumerate(idx):
            nxt = v[i, idx[j + 1]] if j + 1 < len(idx) else terminal[i]
            out[i, t] = nxt - v[i, t]
    return out


def rpp_baseline_ref(r, mask):
    centred = np.zeros_like(r)
    for i in range(r.shape[0]):
        v = ~np.isnan(r[i])
        if v.sum() > 1:
            centred[i, v] = r[i, v] - r[i, v].mean()
    tokens = mask & ~np.isnan(r)[..., None]
    return whiten_ref(np.where(tokens, centred[..., None], 0.0), tokens)


# ---------------------------------------------------------------- outcome estimators


def test_grpo_hand_value():
    a = adv.grpo(jnp.array([[1.0, 0.0, 0.0, 1.0]]))
    chex.assert_shape(a, (1, 4))
    np.testing.assert_allclose(a, [[0.8658754, -0.8658754, -0.8658754, 0.8658754]], rtol=1e-6)


def test_rloo_hand_value():
    np.testing.assert_allclose(
        adv.rloo(jnp.array([[1.0, 0.0, 0.0, 0.0]])), [[1, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6
    )


@pytest.mark.parametrize("scale", adv.GRPO_SCALES)
def test_grpo_matches_reference(scale):
    rng = np.random.default_rng(0)
    r = rng.normal(size=(6, 5)).round(1)
    r[0] = 0.3  # identical group
    r[1, 1:] = np.nan  # single valid reward
    r[2, [0, 3]] = np.nan  # missing rewards
    r[3] = np.nan  # nothing valid
    got = functools.partial(adv.grpo, scale=scale)(jnp.asarray(r, jnp.float32))
    chex.assert_shape(got, r.shape)
    np.testing.assert_allclose(got, grpo_ref(r, scale), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[:2] == 0.0) and np.all(np.asarray(got)[3] == 0.0)
    assert np.all(np.asarray(got)[2, [0, 3]] == 0.0)


def test_identical_group_is_exactly_zero():
    # 0.1 * 5 / 5 != 0.1 in floating point: a naive mean would leave noise / (0 + eps).
    r = np.full((6, 5), 0.1, np.float32)
    r[1] = 0.7
    for scale in adv.GRPO_SCALES:
        assert np.all(np.asarray(adv.grpo(jnp.asarray(r), scale=scale)) == 0.0)
    assert np.all(np.asarray(adv.rloo(jnp.asarray(r))) == 0.0)


def test_rloo_matches_reference():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(6, 5))
    r[1, 2] = np.nan
    r[2, 1:] = np.nan
    got = adv.rloo(jnp.asarray(r, jnp.float32))
    np.testing.assert_allclose(got, rloo_ref(r), rtol=1e-5, atol=1e-6)


def test_outcome_bfloat16():
    rng = np.random.default_rng(2)
    r = rng.integers(0, 3, size=(6, 5)).astype(np.float32)
    for fn in (adv.grpo, adv.rloo):
        lo, hi = fn(jnp.asarray(r, jnp.bfloat16)), fn(jnp.asarray(r))
        assert not np.isnan(np.asarray(lo)).any()
        np.testing.assert_allclose(lo, hi, rtol=2e-2, atol=2e-2)


def test_unknown_scale_lists_valid():
    with pytest.raises(ValueError, match="group, batch, none"):
        adv.grpo(jnp.zeros((2, 3)), scale="std")


def test_outcome_rank_error():
    with pytest.raises(AssertionError, match="rewards"):
        adv.grpo(jnp.zeros((6,)))


def test_broadcast_to_tokens():
    a = jnp.array([[1.0, -2.0]])
    mask = jnp.array([[[1, 1, 0], [1, 0, 0]]], bool)
    out = adv.broadcast_to_tokens(a, mask)
    chex.assert_shape(out, (1, 2, 3))
    np.testing.assert_array_equal(out, [[[1, 1, 0], [-2, 0, 0]]])
    with pytest.raises(AssertionError, match="adv"):
        adv.broadcast_to_tokens(jnp.zeros((1, 3)), mask)


# ---------------------------------------------------------------- token-level estimators


@pytest.fixture
def batch():
    rng = np.random.default_rng(3)
    n, t = 5, 7
    mask = make_mask(rng, n, t)
    r = rng.normal(size=(n, t))
    v = rng.normal(size=(n, t))
    return r, v, mask


def test_whiten_matches_reference(batch):
    x, _, m = batch
    got = adv.whiten(jnp.asarray(x, jnp.float32), m)
    np.testing.assert_allclose(got, whiten_ref(x, m), rtol=1e-5, atol=1e-5)
    shifted = adv.whiten(jnp.asarray(x, jnp.float32), m, shift_mean=False)
    np.testing.assert_allclose(
        shifted, np.where(m, whiten_ref(x, m) + x[m].mean(), 0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_mc_returns_and_reinforce_pp(batch, gamma):
    r, _, m = batch
    g = adv.mc_returns(jnp.asarray(r, jnp.float32), m, gamma)
    chex.assert_shape(g, r.shape)
    np.testing.assert_allclose(g, mc_ref(r, m, gamma), rtol=1e-5, atol=1e-5)
    a = functools.partial(adv.reinforce_pp, gamma=gamma)(jnp.asarray(r, jnp.float32), m)
    np.testing.assert_allclose(a, whiten_ref(mc_ref(r, m, gamma), m), rtol=1e-4, atol=1e-5)


def test_reinforce_pp_baseline():
    rng = np.random.default_rng(4)
    p, g, t = 3, 4, 5
    r = rng.normal(size=(p, g))
    r[0, 1] = np.nan
    r[1, 1:] = np.nan  # single valid reward: centred to 0
    mask = make_mask(rng, p * g, t, holes=False).reshape(p, g, t)
    got = adv.reinforce_pp_baseline(jnp.asarray(r, jnp.float32), mask)
    chex.assert_shape(got, (p, g, t))
    np.testing.assert_allclose(got, rpp_baseline_ref(r, mask), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(got)[0, 1] == 0)
    with pytest.raises(AssertionError):
        adv.reinforce_pp_baseline(jnp.zeros((p, g)), jnp.ones((p, g + 1, t), bool))


def test_gae_matches_verl_loop(batch):
    r, v, m = batch
    fn = functools.partial(adv.gae, gamma=0.95, lam=0.9)
    a, ret = fn(jnp.asarray(r, jnp.float32), jnp.asarray(v, jnp.float32), m)
    chex.assert_shape([a, ret], r.shape)
    a_ref, ret_ref = gae_ref(r, v, m, 0.95, 0.9)
    np.testing.assert_allclose(a, a_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_gae_padding_does_not_propagate(batch):
    r, v, m = batch
    r_bad = np.where(m, r, np.nan)
    v_bad = np.where(m, v, 1e6)
    a, ret = adv.gae(jnp.asarray(r_bad), jnp.asarray(v_bad), m, gamma=0.9, lam=0.8)
    a_ref, ret_ref = gae_ref(r, v, m, 0.9, 0.8)
    np.testing.assert_allclose(a, a_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-5)
    # single token: delta = r - V (next value after the last valid token is 0)
    a1, _ = adv.gae(
        jnp.array([[2.0, 5.0]]),
        jnp.array([[0.5, 9.0]]),
        jnp.array([[True, False]]),
        gamma=0.9,
        lam=0.9,
    )
    np.testing.assert_allclose(a1, [[1.5, 0.0]])


def test_gae_lambda_one_is_mc(batch):
    r, v, m = batch
    _, ret = adv.gae(jnp.asarray(r), jnp.asarray(v), m, gamma=0.9, lam=1.0)
    np.testing.assert_allclose(ret, mc_ref(r, m, 0.9), rtol=1e-5, atol=1e-5)


def test_gae_bfloat16(batch):
    r, v, m = batch
    r16, v16 = jnp.asarray(r, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    lo = adv.gae(r16, v16, m, gamma=0.9, lam=0.9)[0]
    hi = adv.gae(r16.astype(jnp.float32), v16.astype(jnp.float32), m, gamma=0.9, lam=0.9)[0]
    assert lo.dtype == jnp.float32 and not np.isnan(np.asarray(lo)).any()
    np.testing.assert_allclose(lo, hi, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3])
def test_truncated_returns(batch, k):
    r, v, m = batch
    fn = functools.partial(adv.truncated_returns, gamma=0.9, k=k)
    got = fn(jnp.asarray(r, jnp.float32), jnp.asarray(v, jnp.float32), m)
    chex.assert_shape(got, r.shape)
    np.testing.assert_allclose(got, truncated_ref(r, v, m, 0.9, k), rtol=1e-4, atol=1e-5)


def test_truncated_returns_k_too_large_is_mc(batch):
    r, v, m = batch
    got = adv.truncated_returns(jnp.asarray(r), jnp.asarray(v), m, gamma=0.8, k=r.shape[1])
    np.testing.assert_allclose(got, mc_ref(r, m, 0.8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k"):
        adv.truncated_returns(jnp.asarray(r), jnp.asarray(v), m, gamma=0.8, k=0)


def test_vineppo_advantages(batch):
    _, v, m = batch
    terminal = np.arange(v.shape[0], dtype=np.float64)
    got = adv.vineppo_advantages(
        jnp.asarray(v, jnp.float32), m, terminal_values=jnp.asarray(terminal)
    )
    np.testing.assert_allclose(got, vineppo_ref(v, m, terminal), rtol=1e-5, atol=1e-5)
    # telescoping: the advantages of a sequence sum to terminal - V(s_0)
    first = v[np.arange(v.shape[0]), np.argmax(m, axis=1)]
    np.testing.assert_allclose(np.asarray(got).sum(1), terminal - first, rtol=1e-5, atol=1e-5)


def test_token_shape_errors_name_arrays():
    with pytest.raises(AssertionError, match="values"):
        adv.gae(jnp.zeros((2, 4)), jnp.zeros((2, 5)), jnp.ones((2, 4), bool), gamma=1.0, lam=1.0)
    with pytest.raises(AssertionError, match="mask"):
        adv.mc_returns(jnp.zeros((2, 4)), jnp.ones((2, 3), bool))
    with pytest.raises(AssertionError, match="terminal_values"):
        adv.vineppo_advantages(
            jnp.zeros((2, 4)), jnp.ones((2, 4), bool), terminal_values=jnp.zeros(3)
        )


@pytest.mark.slow
def test_turn_grpo_matches_numpy_reward_to_go():
    rng = np.random.default_rng(0)
    p, g, k, t = 3, 4, 3, 12
    turn_rewards = rng.normal(size=(p, g, k)).astype(np.float32)
    turn_rewards[1] = 0.5  # an all-equal group: advantage 0
    turn_rewards[2, 1, 1] = np.nan  # a failed environment: that trajectory gets 0
    turn_index = np.sort(rng.integers(-1, k, size=(p, g, t)), axis=-1)
    mask = rng.random((p, g, t)) < 0.7
    got = np.asarray(
        A.turn_grpo(jnp.asarray(turn_rewards), jnp.asarray(turn_index), jnp.asarray(mask), eps=1e-4)
    )
    want = np.zeros((p, g, t), np.float32)
    for i in range(p):
        ok = ~np.isnan(turn_rewards[i]).any(-1)
        totals = turn_rewards[i].sum(-1)
        if ok.sum() < 2 or np.ptp(totals[ok]) == 0:
            continue
        mean, std = totals[ok].mean(), totals[ok].std(ddof=1)
        for j in np.nonzero(ok)[0]:
            for s in range(t):
                turn = turn_index[i, j, s]
                if mask[i, j, s] and turn >= 0:
                    want[i, j, s] = (turn_rewards[i, j, turn:].sum() - mean) / (std + 1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # reward on the last turn only: every token gets its trajectory's GRPO advantage
    last = np.zeros((1, 4, 2), np.float32)
    last[0, :, 1] = [1.0, 0.0, 0.0, 1.0]
    index = np.asarray([[[0, 0, 1, 1]] * 4])
    adv = np.asarray(A.turn_grpo(jnp.asarray(last), jnp.asarray(index), jnp.ones((1, 4, 4), bool)))
    np.testing.assert_allclose(
        adv[0, :, 0], np.asarray(A.grpo(jnp.asarray([[1.0, 0.0, 0.0, 1.0]])))[0], rtol=1e-6
    )
