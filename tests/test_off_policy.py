"""Behaviour weights of stale batches (``relax.objectives.off_policy``) against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives.off_policy import OffPolicyConfig, behaviour_weights


def _data(seed=0, n=6, t=7):
    rng = np.random.default_rng(seed)
    behaviour = rng.normal(-2.0, 0.5, (n, t)).astype(np.float32)
    prox = (behaviour + rng.normal(0.0, 0.6, (n, t))).astype(np.float32)
    mask = rng.random((n, t)) < 0.7
    mask[0] = False  # a sequence with no valid token
    prox[~mask] = np.nan  # padding holds garbage: it must not reach the weights
    return prox, behaviour, mask


def _numpy_weights(prox, behaviour, mask, cfg: OffPolicyConfig):
    log_rho = np.where(mask, prox - behaviour, 0.0).astype(np.float64)
    if cfg.level == "sequence":
        log_rho = np.broadcast_to(log_rho.sum(-1, keepdims=True), mask.shape)
    rho = np.exp(log_rho)
    lower = 1.0 / cfg.cap if cfg.lower is None else cfg.lower
    w = {
        "decoupled": rho,
        "tis": np.minimum(rho, cfg.cap),
        "mis": np.where((rho < lower) | (rho > cfg.cap), 0.0, rho),
    }[cfg.kind]
    return np.where(mask, w, 0.0), rho


@pytest.mark.parametrize("kind", ["decoupled", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_match_numpy(kind, level):
    prox, behaviour, mask = _data()
    cfg = OffPolicyConfig(kind=kind, level=level, cap=1.5, lower=0.6 if kind == "mis" else None)
    w, metrics = behaviour_weights(prox, behaviour, mask, cfg)
    want, rho = _numpy_weights(prox, behaviour, mask, cfg)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5, atol=1e-7)
    valid = rho[mask]
    np.testing.assert_allclose(
        [float(metrics[k]) for k in ("is_weight_mean", "is_weight_min", "is_weight_max")],
        [valid.mean(), valid.min(), valid.max()],
        rtol=1e-5,
    )
    truncated = (valid > 1.5).mean() if kind == "tis" else 0.0
    masked = ((valid > 1.5) | (valid < 0.6)).mean() if kind == "mis" else 0.0
    np.testing.assert_allclose(
        [float(metrics["is_truncated_frac"]), float(metrics["is_masked_frac"])],
        [truncated, masked],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        float(metrics["behaviour_kl"]), (behaviour - prox)[mask].mean(), rtol=1e-5
    )


def test_hand_computed_token_weights():
    prox = np.log(np.array([[3.0, 1.0, 0.25]], np.float32))
    behaviour = np.zeros_like(prox)
    mask = np.ones_like(prox, bool)
    for kind, want in [
        ("decoupled", [3.0, 1.0, 0.25]),
        ("tis", [2.0, 1.0, 0.25]),
        ("mis", [0.0, 1.0, 0.0]),
    ]:
        w, _ = behaviour_weights(prox, behaviour, mask, OffPolicyConfig(kind=kind, cap=2.0))
        np.testing.assert_allclose(np.asarray(w)[0], want, rtol=1e-6)  # mis: lower = 1/cap = 0.5


def test_weights_are_detached():
    prox, behaviour, mask = _data(1)
    prox = np.where(mask, prox, 0.0)

    def total(p, b):
        w, _ = behaviour_weights(p, b, mask, OffPolicyConfig(kind="tis"))
        return jnp.sum(w)

    gp, gb = jax.grad(total, argnums=(0, 1))(jnp.asarray(prox), jnp.asarray(behaviour))
    assert not np.any(np.asarray(gp)) and not np.any(np.asarray(gb))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="correction kind"):
        OffPolicyConfig(kind="vtrace")
    with pytest.raises(ValueError, match="cap"):
        OffPolicyConfig(cap=0.0)
    with pytest.raises(ValueError, match="lower bound"):
        OffPolicyConfig(kind="mis", cap=2.0, lower=3.0)
