"""relax.train.health: the first non-finite quantity and gradient leaf, the skip limit, collapse warnings."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from relax.train.health import (
    QUANTITIES,
    HealthConfig,
    HealthMonitor,
    NonFiniteError,
    first_nonfinite,
    first_nonfinite_leaf,
    leaf_names,
)

TREE = {
    "embed": np.ones((3, 2), np.float32),
    "layers": {"wq": np.ones((2, 2), np.float32), "wk": np.ones((2,), np.float32)},
}


def _numpy_first_bad(tree_leaves) -> int:
    bad = [not np.all(np.isfinite(x)) for x in tree_leaves]
    return bad.index(True) if any(bad) else -1


@pytest.mark.parametrize(
    "where",
    [None, ("embed", (1, 0), np.nan), ("layers.wk", (1,), np.inf), ("layers.wq", (0, 1), -np.inf)],
)
def test_first_nonfinite_leaf_matches_numpy(where):
    tree = {
        "embed": TREE["embed"].copy(),
        "layers": {k: v.copy() for k, v in TREE["layers"].items()},
    }
    if where is not None:
        name, idx, value = where
        leaf = tree["embed"] if name == "embed" else tree["layers"][name.split(".")[1]]
        leaf[idx] = value
    names = leaf_names(tree)
    assert names == ["embed", "layers.wk", "layers.wq"]  # jax.tree.leaves order: sorted dict keys
    leaves = [tree["embed"], tree["layers"]["wk"], tree["layers"]["wq"]]
    got = int(first_nonfinite_leaf(tree))
    assert got == _numpy_first_bad(leaves)
    if where is not None:
        assert names[got] == where[0]


def test_first_nonfinite_follows_the_data_flow_and_the_mask():
    p, g, n = 2, 2, 3
    mask = np.ones((p, g, n), np.int32)
    mask[0, 1, 2] = 0
    batch = {
        "mask": jnp.asarray(mask),
        "rewards": jnp.zeros((p, g)).at[1, 0].set(jnp.nan),  # NaN = missing
        "advantages": jnp.zeros((p, g)),
        "old_logprobs": jnp.zeros((p, g, n)).at[0, 1, 2].set(jnp.nan),
        "ref_logprobs": jnp.zeros((p, g, n)),
    }
    assert (
        int(first_nonfinite(jnp.float32(1.0), **batch)) == -1
    )  # NaN reward and masked NaN log-prob are fine
    assert QUANTITIES[int(first_nonfinite(jnp.float32(jnp.nan), **batch))] == "loss"
    ref_bad = {**batch, "ref_logprobs": batch["ref_logprobs"].at[1, 1, 1].set(jnp.inf)}
    assert QUANTITIES[int(first_nonfinite(jnp.float32(jnp.nan), **ref_bad))] == "ref_logprobs"
    rew_bad = {**ref_bad, "rewards": batch["rewards"].at[0, 0].set(jnp.inf)}
    assert QUANTITIES[int(first_nonfinite(jnp.float32(1.0), **rew_bad))] == "rewards"
    no_ref = {k: v for k, v in batch.items() if k != "ref_logprobs"}
    assert int(first_nonfinite(jnp.float32(0.0), **no_ref)) == -1
    # a trainer without rollouts (SFT) passes the loss alone; the quantities are keyword-only
    assert int(first_nonfinite(jnp.float32(0.0))) == -1
    assert QUANTITIES[int(first_nonfinite(jnp.float32(jnp.inf)))] == "loss"
    with pytest.raises(TypeError):
        first_nonfinite(jnp.float32(0.0), batch["rewards"])


def _monitor(**cfg):
    warnings = []
    m = HealthMonitor(
        HealthConfig(**cfg),
        grad_leaves=["embed", "layers.wk", "layers.wq"],
        vocab_size=16,
        warn=warnings.append,
    )
    return m, warnings


OK = {"first_nonfinite": -1, "first_nonfinite_grad": -1, "consecutive_skips": 0}


def test_skip_limit_names_the_first_cause_of_the_streak():
    m, _ = _monitor(max_consecutive_skips=3)
    metrics = {"entropy": 1.0, "grad_norm": 0.5}
    m.check(1, metrics, OK)
    m.check(2, metrics, {"first_nonfinite": -1, "first_nonfinite_grad": 2, "consecutive_skips": 1})
    m.check(3, metrics, {"first_nonfinite": 4, "first_nonfinite_grad": 0, "consecutive_skips": 2})
    with pytest.raises(
        NonFiniteError,
        match=r"3 optimizer steps in a row.*began at iteration 2 with non-finite "
        r"gradient of layers.wq \(the loss is finite\)",
    ):
        m.check(
            4, metrics, {"first_nonfinite": 1, "first_nonfinite_grad": 0, "consecutive_skips": 3}
        )


def test_a_step_that_applies_ends_the_streak():
    m, _ = _monitor(max_consecutive_skips=2)
    bad = {"first_nonfinite": 3, "first_nonfinite_grad": 0, "consecutive_skips": 1}
    for step in range(1, 6):  # skip, apply, skip, apply, ...: never two in a row
        m.check(step, {"grad_norm": 1.0}, bad if step % 2 else OK)
    assert m.cause({**bad, "first_nonfinite": 4}) == "non-finite loss and gradient of embed"
    assert m.cause(bad) == "non-finite ref_logprobs"


def test_collapse_warnings_once_per_streak():
    m, warnings = _monitor(collapse_patience=3)
    uniform = {"entropy": math.log(16) * (1 - 1e-4), "grad_norm": 0.3}
    for step in range(1, 6):
        m.check(step, uniform, OK)
    assert len(warnings) == 1 and "ln V = 2.7726" in warnings[0]
    m.check(6, {"entropy": 1.0, "grad_norm": 0.3}, OK)
    for step in range(7, 9):  # a new streak shorter than the patience: no warning
        m.check(step, uniform, OK)
    for step in range(9, 12):
        m.check(step, {"entropy": 1.0, "grad_norm": 0.0}, OK)
    assert len(warnings) == 2 and "gradient norm is exactly 0" in warnings[1]


def test_restored_weights_with_a_nan_are_refused_naming_the_leaf():
    import equinox as eqx
    import jax

    from relax.models import init, small_config
    from relax.train.health import check_finite_weights

    model = init(
        small_config(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
        ),
        jax.random.key(0),
    )
    check_finite_weights(model, "fine")  # nothing raised
    bad = eqx.tree_at(lambda m: m.layers.wo, model, model.layers.wo.at[1, 0, 0].set(jnp.inf))
    with pytest.raises(
        NonFiniteError, match=r"the checkpoint: weight 'layers\.wo' holds NaN or infinite values"
    ):
        check_finite_weights(bad, "the checkpoint")
