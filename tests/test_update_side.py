"""``make_update(side=...)``: row inputs made by a second part of the params (a trained vision
tower's image features) inside the gradient, once per optimizer step. Checked against plain SGD
on the whole minibatch's loss differentiated directly (no vjp, no scatter), over micro-batches,
minibatches and epochs, and with a LoRA-like frozen half."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from relax.models.adapters.operations import split_trainable
from relax.train.update import SideInputs, make_update

ROWS, IMAGES, K, D = 8, 11, 5, 3


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    owner = np.sort(rng.integers(0, ROWS, IMAGES)).astype(np.int32)  # images of each row, ragged
    side_data = {"pixels": jnp.asarray(rng.normal(size=(IMAGES, K)), jnp.float32), "owner": owner}
    batch = {
        "y": jnp.asarray(rng.normal(size=(ROWS, 4)), jnp.float32),
        "loss_mask": jnp.asarray(rng.integers(0, 2, (ROWS, 4)), jnp.float32),
        "feat": jnp.zeros((ROWS, D), jnp.float32),  # what the sampler saw: replaced in the update
    }
    params = (
        {"w": jnp.asarray(rng.normal(size=(D, 4)), jnp.float32)},
        {"tower": jnp.asarray(rng.normal(size=(K, D)) / 2, jnp.float32)},
    )
    return params, batch, side_data


def _encode(side, data):
    per_image = jnp.tanh(data["pixels"] @ side["tower"])  # [images, D]
    return jax.ops.segment_sum(per_image, data["owner"], num_segments=ROWS)  # [rows, D]


SIDE = SideInputs(encode=_encode, place=lambda mb, r: {**mb, "feat": r})


def _loss(main, mb, ctx):
    err = mb["feat"] @ main["w"] - mb["y"]
    return jnp.sum(mb["loss_mask"] * err**2) / ctx.norms["tokens"], {}


def _direct(params, batch, side_data, rows, tokens):
    """The minibatch ``rows``' loss as one function of both parts (the reference)."""
    main, side = params
    feat = _encode(side, side_data)[rows]
    err = feat @ main["w"] - batch["y"][rows]
    return jnp.sum(batch["loss_mask"][rows] * err**2) / tokens


def _reference(params, batch, side_data, key, *, epochs, minibatches, lr):
    """Plain SGD, each epoch's rows permuted as ``make_update`` permutes them."""
    tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0) / minibatches
    for epoch_key in jax.random.split(key, epochs):
        perm = np.asarray(jax.random.permutation(epoch_key, ROWS))
        for rows in perm.reshape(minibatches, -1):
            g = jax.grad(_direct)(params, batch, side_data, jnp.asarray(rows), tokens)
            params = jax.tree.map(lambda p, d: p - lr * d, params, g)
    return params


def _check(epochs: int, minibatches: int, grad_accum: int):
    params, batch, side_data = _data()
    opt = optax.sgd(0.05)
    update = make_update(
        _loss, opt, epochs=epochs, minibatches=minibatches, grad_accum=grad_accum, side=SIDE
    )
    key = jax.random.key(3)
    got, _, metrics = jax.jit(update)(params, opt.init(params), batch, key, side_data=side_data)
    want = _reference(
        params, batch, side_data, key, epochs=epochs, minibatches=minibatches, lr=0.05
    )
    for g, w, p in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(params)):
        assert not np.allclose(w, p)  # the step moved both parts
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    assert np.isfinite(float(metrics["grad_norm"]))


def test_one_step_over_micro_batches_equals_the_whole_batch_gradient():
    _check(epochs=1, minibatches=1, grad_accum=4)


def test_features_are_recomputed_after_each_step_of_minibatches_and_epochs():
    """Two minibatches x two epochs: each step's rows take the side part as the step before
    left it, and a minibatch's gradient reaches only its own rows' images."""
    _check(epochs=2, minibatches=2, grad_accum=2)


def test_a_frozen_leaf_of_the_side_part_is_not_trained():
    """Only trainable leaves move: an integer leaf (not differentiable) rides along unchanged."""
    params, batch, side_data = _data()
    side_params = {**params[1], "index": jnp.arange(3)}
    params = (params[0], side_params)
    opt = optax.adam(1e-2)
    update = make_update(_loss, opt, grad_accum=2, side=SIDE)
    state = opt.init(split_trainable(params)[0])
    got, _, _ = update(params, state, batch, jax.random.key(0), side_data=side_data)
    np.testing.assert_array_equal(got[1]["index"], np.arange(3))
    assert not np.allclose(got[1]["tower"], side_params["tower"])
