"""Value-function (critic) loss for PPO-style training."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.masked import assert_same_shape, masked_mean


def clipped_value_loss(
    values: Float[Array, "n t"],
    old_values: Float[Array, "n t"],
    returns: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    clip_range: float | None,
) -> tuple[Float[Array, "n t"], dict[str, Float[Array, ""]]]:
    """Per-token clipped value loss (PPO; verl ``compute_value_loss``, TRL ``cliprange_value``)::

        V_clip = clip(V, V_old - c, V_old + c)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)          where mask, else 0

    ``clip_range=None`` disables clipping (``loss = 0.5 (V - R)^2``); ``clip_range=0.0`` is a valid
    (fully clipped) value. Returns the per-token loss, to be reduced by the caller's aggregation
    (verl applies ``0.5 * agg_loss(...)``; the 0.5 lives here instead), and metrics:

    - ``vf_clipfrac``: masked mean of ``[(V_clip - R)^2 > (V - R)^2]`` (verl's definition),
    - ``vf_mse``: masked mean of ``(V - R)^2``.

    Computed in float32 (at least); ``old_values`` and ``returns`` get no gradient by construction
    (they are inputs, not functions of ``values``).
    """
    assert_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None and clip_range < 0:
        raise ValueError(f"clip_range must be >= 0 or None, got {clip_range}")
    dt = jnp.promote_types(jnp.result_type(values), jnp.float32)
    v, v_old, r = (jnp.asarray(a).astype(dt) for a in (values, old_values, returns))
    m = jnp.asarray(mask).astype(bool)
    unclipped = (v - r) ** 2
    if clip_range is None:
        worst, clipped_more = unclipped, jnp.zeros_like(unclipped)
    else:
        v_clip = jnp.clip(v, v_old - clip_range, v_old + clip_range)
        clipped = (v_clip - r) ** 2
        worst, clipped_more = jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(dt)
    loss = jnp.where(m, 0.5 * worst, 0.0)
    metrics = {"vf_clipfrac": masked_mean(clipped_more, m), "vf_mse": masked_mean(unclipped, m)}
    return loss, metrics


def explained_variance(
    values: Float[Array, "n t"], returns: Float[Array, "n t"], mask: Bool[Array, "n t"]
) -> Float[Array, ""]:
    """How much of the returns' variance the values explain, over valid tokens (verl's
    ``critic/vf_explained_var``, TRL's ``val/var_explained``)::

        ev = 1 - Var(R - V) / Var(R)        (population variances; 0 when Var(R) = 0)

    1 is a perfect critic, 0 one no better than a constant, negative one worse than that.
    """
    assert_same_shape(values=values, returns=returns, mask=mask)
    m = jnp.asarray(mask).astype(bool)
    v, r = (
        jnp.asarray(a).astype(jnp.promote_types(jnp.result_type(a), jnp.float32))
        for a in (values, returns)
    )

    def var(x):
        mu = masked_mean(x, m)
        return masked_mean(jnp.square(x - mu), m)

    var_r = var(r)
    return jnp.where(var_r > 0, 1.0 - var(r - v) / jnp.where(var_r > 0, var_r, 1.0), 0.0)
