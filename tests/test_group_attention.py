"""prefix_group_attention against a numpy softmax over [prompt keys; own keys], and its custom
backward against autodiff of a plain jnp implementation."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models.attention.group import prefix_group_attention

P, G, HK, M_R, N, LP, D = 2, 3, 2, 2, 5, 4, 8  # M_R query heads per KV head: rows m = (r, t)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    q, pk, pv = f(P, HK, G, M_R * N, D), f(P, HK, LP, D), f(P, HK, LP, D)
    k, v = f(P, HK, G, N, D), f(P, HK, G, N, D)
    p_valid = np.ones((P, LP), bool)
    p_valid[1, :2] = False  # left padding
    p_len = p_valid.sum(1)
    p_pos = np.maximum(np.cumsum(p_valid, 1) - 1, 0)
    k_pos = np.broadcast_to(p_len[:, None, None] + np.arange(N), (P, G, N)).copy()
    k_valid = np.ones((P, G, N), bool)
    k_valid[0, 1, 3:] = False  # a completion that stopped early
    q_pos = np.tile(k_pos, (1, 1, M_R))
    return q, pk, pv, k, v, q_pos, p_pos, p_valid, k_pos, k_valid


def _numpy_attention(q, pk, pv, k, v, q_pos, p_pos, p_valid, k_pos, k_valid, window):
    out = np.zeros(q.shape, np.float64)
    for p in range(P):
        for g in range(G):
            keys_pos = np.concatenate([p_pos[p], k_pos[p, g]])
            keys_ok = np.concatenate([p_valid[p], k_valid[p, g]])
            for h in range(HK):
                kk = np.concatenate([pk[p, h], k[p, h, g]]).astype(np.float64)
                vv = np.concatenate([pv[p, h], v[p, h, g]]).astype(np.float64)
                for m in range(q.shape[3]):
                    ok = keys_ok & (keys_pos <= q_pos[p, g, m])
                    if window is not None:
                        ok &= q_pos[p, g, m] - keys_pos < window
                    s = kk @ q[p, h, g, m] / np.sqrt(D)
                    w = np.where(ok, np.exp(s - s[ok].max()), 0.0)
                    out[p, h, g, m] = (w / w.sum()) @ vv
    return out


def _plain(q, pk, pv, k, v, q_pos, p_pos, p_valid, k_pos, k_valid, window):
    """Unblocked jnp attention (autodiff backward): keys [prompt; own] per completion."""
    kk = jnp.concatenate([jnp.broadcast_to(pk[:, :, None], (P, HK, G, LP, D)), k], axis=3)
    vv = jnp.concatenate([jnp.broadcast_to(pv[:, :, None], (P, HK, G, LP, D)), v], axis=3)
    kpos = jnp.concatenate([jnp.broadcast_to(p_pos[:, None], (P, G, LP)), k_pos], axis=2)
    kok = jnp.concatenate([jnp.broadcast_to(p_valid[:, None], (P, G, LP)), k_valid], axis=2)
    ok = kok[:, :, None, :] & (kpos[:, :, None, :] <= q_pos[..., None])
    if window is not None:
        ok &= q_pos[..., None] - kpos[:, :, None, :] < window
    s = jnp.einsum("phgmd,phgsd->phgms", q, kk) / np.sqrt(D)
    s = jnp.where(ok[:, None], s, -jnp.inf)
    return jnp.einsum("phgms,phgsd->phgmd", jax.nn.softmax(s, axis=-1), vv)


@pytest.mark.parametrize("window", [None, 3])
def test_forward_matches_numpy(window):
    args = _inputs(0)
    got = prefix_group_attention(*map(jnp.asarray, args), window=window)
    chex.assert_shape(got, (P, HK, G, M_R * N, D))
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(*args, window), atol=2e-5)


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_backward_matches_autodiff_of_plain_attention(window, save):
    # save=True: the backward uses the forward's probabilities instead of recomputing them
    args = tuple(map(jnp.asarray, _inputs(1)))
    w = jax.random.normal(jax.random.key(0), (P, HK, G, M_R * N, D))
    loss = lambda f: lambda *x: jnp.sum(w * f(*x, *args[5:], window=window))
    attend = functools.partial(prefix_group_attention, save_probabilities=save)
    got = jax.grad(loss(attend), argnums=range(5))(*args[:5])
    want = jax.grad(loss(lambda *x, window: _plain(*x, window)), argnums=range(5))(*args[:5])
    for name, a, b in zip(["q", "pk", "pv", "k", "v"], got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=name)


def test_groups_per_step_does_not_change_values_or_gradients():
    args = tuple(map(jnp.asarray, _inputs(2)))
    w = jax.random.normal(jax.random.key(1), (P, HK, G, M_R * N, D))
    f = lambda b: jax.value_and_grad(
        lambda *x: jnp.sum(w * prefix_group_attention(*x, *args[5:], groups_per_step=b)),
        argnums=range(5),
    )(*args[:5])
    chex.assert_trees_all_close(
        f(P), f(1), atol=1e-5, rtol=1e-4
    )  # only the summation order differs
    saved = jax.value_and_grad(
        lambda *x: jnp.sum(
            w * prefix_group_attention(*x, *args[5:], groups_per_step=P, save_probabilities=True)
        ),
        argnums=range(5),
    )(*args[:5])
    chex.assert_trees_all_close(saved, f(1), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="groups_per_step=3 does not divide the 2 prompt groups"):
        prefix_group_attention(*args, groups_per_step=3)
