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
    "first_mean": (1 + 2 + 12) / 4,  # the first step's token-weighted mean
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


def test_a_metric_weight_replaces_the_token_weights():
    """A mean over sequences weighted by each micro-batch's sequences (3, 1, 0), not its tokens."""
    x, seqs, tokens = jnp.asarray([2.0, 6.0, 0.0]), jnp.asarray([3.0, 1.0, 0.0]), jnp.ones(3)
    for reduction in ("mean", "first_mean"):
        step = reduce_micro({"x": Metric(x, reduction, seqs)}, tokens)["x"]
        assert step.weight is None  # the step's value carries no weight on
        got = values(reduce_steps({"x": Metric(jnp.stack([step.value, 100.0]), reduction)}))["x"]
        want = (3 * 2 + 6) / 4 if reduction == "first_mean" else ((3 * 2 + 6) / 4 + 100) / 2
        np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_a_weight_on_a_reduction_that_does_not_read_it_is_refused():
    with pytest.raises(ValueError, match="not by 'max'"):
        Metric(jnp.asarray(1.0), "max", jnp.asarray(2.0))
