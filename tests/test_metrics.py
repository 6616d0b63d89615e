"""Declared metric reductions (relax.metrics) against hand-computed values: two optimizer steps of
three micro-batches each."""

import jax.numpy as jnp
import numpy as np
import pytest

from relax.metrics import Metric, reduce_micro, reduce_steps, values

STEPS = np.array([[1.0, 2.0, 6.0], [3.0, -1.0, 4.0]])  # [step, micro-batch]
WEIGHTS = np.array(
    [[1.0, 1.0, 2.0], [0.0, 0.0, 0.0]]
)  # loss tokens per micro-batch; step 2 has none

WANT = {
    "mean": np.mean(
        [(1 + 2 + 12) / 4, (3 - 1 + 4) / 3]
    ),  # token-weighted; a plain mean without tokens
    "sum": 15.0,
    "share": np.mean([9.0, 6.0]),  # summed over micro-batches, averaged over steps
    "max": 6.0,
    "min": -1.0,
    "first_step": 6.0,  # the first step's largest
    "first_found": 1.0,
}


@pytest.mark.parametrize("reduction", sorted(WANT))
def test_reductions_hand_values(reduction):
    per_step = [
        reduce_micro({"x": Metric(jnp.asarray(x), reduction)}, jnp.asarray(w))["x"]
        for x, w in zip(STEPS, WEIGHTS)
    ]
    stacked = Metric(jnp.stack([m.value for m in per_step]), reduction)
    got = values(reduce_steps({"x": stacked}))["x"]
    np.testing.assert_allclose(float(got), WANT[reduction], rtol=1e-6)


def test_first_found_is_minus_one_when_nothing_is_found():
    m = reduce_micro({"x": Metric(jnp.asarray([-1.0, -1.0]), "first_found")}, jnp.ones(2))["x"]
    assert float(m.value) == -1.0


def test_share_is_the_same_whatever_the_micro_batch_split():
    """A loss term under global normalisers: one micro-batch of 6 tokens or three of 2 give one value."""
    contributions = jnp.asarray([0.5, 0.25, 1.0])  # each micro-batch's term, already / all tokens
    split = reduce_micro({"x": Metric(contributions, "share")}, jnp.full(3, 2.0))["x"]
    whole = reduce_micro({"x": Metric(jnp.sum(contributions)[None], "share")}, jnp.full(1, 6.0))[
        "x"
    ]
    np.testing.assert_allclose(float(split.value), float(whole.value))
    mean = reduce_micro({"x": Metric(contributions, "mean")}, jnp.full(3, 2.0))["x"]
    assert not np.isclose(
        float(mean.value), float(whole.value)
    )  # what "mean" got wrong for such terms
