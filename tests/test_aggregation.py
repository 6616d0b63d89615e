"""Loss aggregation: NumPy references, TRL names, and minibatch / gradient-accumulation invariance."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives import aggregation as agg

aggregate = jax.jit(agg.aggregate, static_argnames="mode")
N, T = 8, 6


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    loss = rng.normal(size=(N, T))
    lengths = rng.integers(1, T + 1, size=N)
    lengths[3] = 0  # a fully masked row
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[0, 1] = False
    return loss, mask


def aggregate_ref(loss, mask, mode, num_sequences=None, num_tokens=None, max_len=None):
    num_sequences = loss.shape[0] if num_sequences is None else num_sequences
    num_tokens = max(mask.sum(), 1) if num_tokens is None else num_tokens
    max_len = loss.shape[1] if max_len is None else max_len
    total = 0.0
    for i in range(loss.shape[0]):
        seq_sum = sum(loss[i, t] for t in range(loss.shape[1]) if mask[i, t])
        if mode == "token-mean":
            total += seq_sum / num_tokens
        elif mode == "seq-mean-token-mean":
            total += seq_sum / max(mask[i].sum(), 1) / num_sequences
        elif mode == "seq-mean-token-sum":
            total += seq_sum / num_sequences
        else:
            total += seq_sum / (num_sequences * max_len)
    return total


@pytest.mark.parametrize("mode", agg.AGGREGATION_MODES)
def test_matches_reference(mode):
    loss, mask = make_batch()
    got = aggregate(jnp.asarray(loss, jnp.float32), mask, mode)
    chex.assert_shape(got, ())
    np.testing.assert_allclose(got, aggregate_ref(loss, mask, mode), rtol=1e-5)
    explicit = aggregate(
        jnp.asarray(loss, jnp.float32), mask, mode, num_sequences=20, num_tokens=50, max_len=16
    )
    np.testing.assert_allclose(explicit, aggregate_ref(loss, mask, mode, 20, 50, 16), rtol=1e-5)


def test_trl_loss_types():
    assert agg.resolve_mode("grpo") == "seq-mean-token-mean"
    assert agg.resolve_mode("bnpo") == "token-mean"
    assert agg.resolve_mode("dapo") == "token-mean"
    assert agg.resolve_mode("dr_grpo") == "seq-mean-token-sum-norm"
    for mode in agg.AGGREGATION_MODES:
        assert agg.resolve_mode(mode) == mode
    loss, mask = make_batch(1)
    x = jnp.asarray(loss, jnp.float32)
    # TRL's dr_grpo: sum / (batch size * max_completion_length)
    np.testing.assert_allclose(
        aggregate(x, mask, "dr_grpo", max_len=10), loss[mask].sum() / (N * 10), rtol=1e-5
    )
    np.testing.assert_allclose(aggregate(x, mask, "bnpo"), loss[mask].mean(), rtol=1e-5)


def test_unknown_mode_lists_valid_names():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean.*dr_grpo"):
        agg.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3), bool), "mean")


def test_shape_errors_name_arrays():
    with pytest.raises(AssertionError, match="per_token_loss"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((2, 4), bool), "token-mean")
    with pytest.raises(AssertionError, match="N, T"):
        aggregate(jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 4), bool), "token-mean")


def per_token_loss(theta, x):
    """A small differentiable per-token loss of shared parameters, ``[N, T]``."""
    return jnp.tanh(x * theta[0] + theta[1]) ** 2 + theta[2] * x


@pytest.mark.parametrize("mode", agg.AGGREGATION_MODES)
def test_minibatches_add_up_to_the_full_batch(mode):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(N, T)), jnp.float32)
    _, mask = make_batch(2)
    theta = jnp.array([0.7, -0.2, 0.3])
    norms = dict(num_sequences=N, num_tokens=int(mask.sum()), max_len=T)  # the WHOLE batch's

    @jax.jit
    def value_and_grad(th, xs, ms, num_sequences=None, num_tokens=None):
        def f(th):
            loss = per_token_loss(th, xs)
            return agg.aggregate(
                loss, ms, mode, num_sequences=num_sequences, num_tokens=num_tokens, max_len=T
            )

        return jax.value_and_grad(f)(th)

    full, full_grad = value_and_grad(theta, x, mask)  # defaults = the full batch's statistics
    perm = rng.permutation(N)
    parts = [
        value_and_grad(theta, x[i], mask[i], norms["num_sequences"], norms["num_tokens"])
        for i in perm.reshape(4, -1)
    ]
    np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(p[1] for p in parts), full_grad, rtol=1e-5, atol=1e-6)


def test_local_normalisers_do_not_add_up():
    # The failure the explicit normalisers prevent: per-minibatch token-mean (TRL's bnpo) with
    # uneven lengths is not the full batch's token-mean.
    loss, mask = make_batch(3)
    x = jnp.asarray(loss, jnp.float32)
    full = aggregate(x, mask, "token-mean")
    local = sum(aggregate(x[i : i + 2], mask[i : i + 2], "token-mean") for i in range(0, N, 2)) / 4
    assert abs(float(full) - float(local)) > 1e-3


def test_traced_normalisers_and_bfloat16():
    loss, mask = make_batch(4)
    x16 = jnp.asarray(loss, jnp.bfloat16)
    count = jnp.asarray(mask.sum(), jnp.float32)
    for mode in agg.AGGREGATION_MODES:
        lo = aggregate(x16, mask, mode, num_tokens=count, num_sequences=jnp.float32(N))
        hi = aggregate(x16.astype(jnp.float32), mask, mode)
        assert lo.dtype == jnp.float32 and np.isfinite(float(lo))
        np.testing.assert_allclose(lo, hi, rtol=1e-6, atol=1e-6)


def test_finite_differences():
    with jax.enable_x64(True):
        loss, mask = make_batch(5)
        theta = np.array([0.4, 0.1, -0.5])
        x = np.random.default_rng(6).normal(size=(N, T))
        for mode in agg.AGGREGATION_MODES:
            f = jax.jit(lambda th, mode=mode: agg.aggregate(per_token_loss(th, x), mask, mode))
            h = 1e-6
            fd = np.array([(f(theta + h * e) - f(theta - h * e)) / (2 * h) for e in np.eye(3)])
            np.testing.assert_allclose(jax.grad(f)(theta), fd, rtol=1e-6, atol=1e-9)
