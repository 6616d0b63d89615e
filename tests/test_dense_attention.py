"""prefix_dense_attention (the fused-kernel layout of the training attention) against the numpy
softmax of test_group_attention, its gradients against autodiff of the plain jnp form, and the
trainer's log-probs with either implementation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models import ModelConfig, cast, init
from relax.models.attention.dense import prefix_dense_attention
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from tests.test_group_attention import HK, M_R, D, G, N, P, _inputs, _numpy_attention, _plain

B = P * G


def _to_dense(q, pk, pv, k, v):
    """Group layout (rows m = (r, t) of KV head h) -> token-major [B, N, heads, D] (head h*R + r)."""
    qd = (
        np.asarray(q)
        .reshape(P, HK, G, M_R, N, D)
        .transpose(0, 2, 4, 1, 3, 5)
        .reshape(B, N, HK * M_R, D)
    )
    kv = lambda x: np.asarray(x).transpose(0, 2, 3, 1, 4).reshape(B, N, HK, D)
    return qd, kv(k), kv(v), pk, pv


def _from_dense(o):
    return (
        np.asarray(o)
        .reshape(P, G, N, HK, M_R, D)
        .transpose(0, 3, 1, 4, 2, 5)
        .reshape(P, HK, G, M_R * N, D)
    )


def _valid_rows(k_valid):
    """[P, HK, G, M, 1]: query rows whose completion token is valid (the dense form assumes prefix masks)."""
    rows = np.tile(k_valid, (1, 1, M_R))  # [P, G, M]
    return np.broadcast_to(rows[:, None, :, :, None], (P, HK, G, M_R * N, D))


def test_forward_matches_numpy():
    args = _inputs(3)
    q, pk, pv, k, v, *_, p_valid, _, k_valid = args
    p_len = jnp.asarray(p_valid.sum(1))
    got = prefix_dense_attention(
        *map(jnp.asarray, _to_dense(q, pk, pv, k, v)), p_len, implementation="xla"
    )
    chex.assert_shape(got, (B, N, HK * M_R, D))
    want = _numpy_attention(*args, None)
    ok = _valid_rows(k_valid)
    np.testing.assert_allclose(_from_dense(got)[ok], want[ok], atol=2e-5)


@pytest.mark.slow
def test_backward_matches_autodiff_of_plain_attention():
    args = tuple(map(jnp.asarray, _inputs(4)))
    p_len = jnp.asarray(np.asarray(args[7]).sum(1))
    ok = jnp.asarray(_valid_rows(np.asarray(args[9])))
    w = jax.random.normal(jax.random.key(2), (P, HK, G, M_R * N, D)) * ok  # loss on valid rows only

    def dense_loss(q, pk, pv, k, v):
        qd = q.reshape(P, HK, G, M_R, N, D).transpose(0, 2, 4, 1, 3, 5).reshape(B, N, HK * M_R, D)
        kv = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(B, N, HK, D)
        o = prefix_dense_attention(qd, kv(k), kv(v), pk, pv, p_len, implementation="xla")
        o = o.reshape(P, G, N, HK, M_R, D).transpose(0, 3, 1, 4, 2, 5).reshape(P, HK, G, M_R * N, D)
        return jnp.sum(w * o)

    got = jax.grad(dense_loss, argnums=range(5))(*args[:5])
    want = jax.grad(lambda *x: jnp.sum(w * _plain(*x, *args[5:], None)), argnums=range(5))(
        *args[:5]
    )
    for name, a, b in zip(["q", "pk", "pv", "k", "v"], got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.slow
def test_trainer_logprobs_and_gradients_agree_between_implementations():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    model = init(cfg, jax.random.key(0))
    k = jax.random.split(jax.random.key(1), 2)
    ids = jax.random.randint(k[0], (2, 6), 0, 64)
    pm = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)  # left padding
    comp = jax.random.randint(k[1], (2, 3, 5), 0, 64)
    cm = jnp.ones((2, 3, 5), jnp.int32).at[0, 1, 3:].set(0)  # one completion stopped early

    def run(attention):
        def loss(m):
            how = ForwardPass(attention=attention, with_entropy=True)
            lp, ent = completion_logprobs(m, ids, pm, comp, cm, how, temperature=0.7)
            return jnp.sum(jnp.where(cm > 0, lp + 0.1 * ent, 0.0)), (lp, ent)

        (_, (lp, ent)), grads = jax.value_and_grad(loss, has_aux=True)(model)
        return jnp.where(cm > 0, lp, 0.0), jnp.where(cm > 0, ent, 0.0), grads

    chex.assert_trees_all_close(run("dense"), run("group"), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown train attention 'flash'"):
        ForwardPass(attention="flash")


def test_auto_takes_the_fused_kernel_only_where_it_runs():
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.grpo.config import GRPOConfig
    from relax.models.forward.config import ForwardConfig
    from relax.models.forward.forward_pass import resolve_attention

    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    windowed = init(ModelConfig(**base, sliding_window=4), jax.random.key(0))
    with pytest.raises(ValueError, match="train attention 'dense' has no sliding window"):
        resolve_attention("dense", windowed)
    assert resolve_attention("auto", windowed) == "group"
    plain = init(ModelConfig(**base), jax.random.key(0))
    assert (
        resolve_attention("auto", plain) == "group"
    )  # float32: cuDNN's flash attention is 16-bit only
    half = cast(plain, dtype=jnp.bfloat16)
    assert resolve_attention("auto", half) == (
        "dense" if jax.default_backend() == "gpu" else "group"
    )
    assert resolve_attention("dense", plain) == "dense"
    with pytest.raises(ValueError, match="unknown train_attention 'flash'"):
        configure(GRPOConfig, train_attention="flash")
    with pytest.raises(ValueError, match="unknown remat_policy 'some'"):
        configure(GRPOConfig, remat_policy="some")
    with pytest.raises(ValueError, match="unknown train_attention 'flash'"):
        ForwardConfig(train_attention="flash")
