"""``make_update(skip_empty=True)`` (the packed update's empty bins): rows with no loss token are
dealt last and never computed, each minibatch gets its share of the rows that have one, and the
result equals the update of the non-empty rows alone; ``relax.metrics.neutral``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from relax import metrics as M
from relax.train.update import make_update


def _loss(w, mb, ctx):
    """A least-squares loss that is NaN on a row with no loss token (0 / 0), with a metric of
    every reduction."""
    x, y, mask = mb["x"], mb["y"], mb["loss_mask"]
    per_row = jnp.sum(mask * (x @ w - y) ** 2, -1) / jnp.sum(mask, -1)
    loss = jnp.sum(per_row) / ctx.norms["tokens"]
    r = x[:, 0, 0]
    metrics = {
        "mean": M.Metric(jnp.mean(r)),
        "max": M.Metric(jnp.max(r) - 100.0, "max"),  # negative: a zero would win the max
        "min": M.Metric(jnp.min(r) + 100.0, "min"),
        "sum": M.Metric(jnp.sum(mask), "sum"),
        "rows": M.Metric(jnp.float32(x.shape[0]), "sum"),
    }
    return loss, metrics


def _batch(rows: int, active: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3, 2)).astype(np.float32)
    y = rng.normal(size=(rows, 3)).astype(np.float32)
    mask = np.zeros((rows, 3), np.float32)
    mask[active] = 1.0
    return {"x": jnp.asarray(x), "y": jnp.asarray(y), "loss_mask": jnp.asarray(mask)}


def test_empty_rows_are_skipped_and_change_nothing():
    batch = _batch(8, [1, 4, 6])
    opt = optax.sgd(0.1)
    w0 = jnp.ones((2,), jnp.float32)
    skip = make_update(_loss, opt, grad_accum=8, skip_empty=True)
    w, _, metrics = jax.jit(skip)(w0, opt.init(w0), batch, jax.random.key(0))
    assert np.isfinite(np.asarray(w)).all()  # the NaN rows never ran
    alone = {k: v[jnp.array([1, 4, 6])] for k, v in batch.items()}
    want, _, want_metrics = make_update(_loss, opt, grad_accum=3)(
        w0, opt.init(w0), alone, jax.random.key(0)
    )
    np.testing.assert_allclose(w, want, rtol=1e-6)
    for name in ("mean", "max", "min", "sum"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-6, err_msg=name)
    assert float(metrics["rows"]) == 3.0  # only the three non-empty micro-batches reported rows


def test_each_minibatch_gets_its_share_of_the_non_empty_rows():
    """Two minibatches over 8 rows of which 2 have loss tokens: one in each optimizer step."""
    batch = _batch(8, [2, 7])
    opt = optax.sgd(0.1)
    w0 = jnp.ones((2,), jnp.float32)

    def counting(w, mb, ctx):
        loss, metrics = _loss(w, mb, ctx)
        return loss, {"tokens_first": M.Metric(jnp.sum(mb["loss_mask"]), "first_step")}

    for key in range(4):
        update = make_update(counting, opt, minibatches=2, grad_accum=4, skip_empty=True)
        _, _, metrics = jax.jit(update)(w0, opt.init(w0), batch, jax.random.key(key))
        assert float(metrics["tokens_first"]) == 3.0  # the first step: one row of 3 tokens


def test_neutral_metrics_leave_every_reduction_unchanged():
    values = {"mean": 2.0, "sum": 3.0, "max": -5.0, "min": 5.0, "first_found": 4}
    for reduction, v in values.items():
        m = M.Metric(jnp.asarray(v), reduction)
        stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), m, M.neutral(m))
        out = M.reduce_micro({"x": stacked}, jnp.array([1.0, 0.0]))["x"]
        np.testing.assert_allclose(out.value, v, err_msg=reduction)
