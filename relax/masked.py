"""Masked reductions over ``[N, T]`` (or any-shape) arrays, and a named shape check.

Every function takes an explicit ``mask`` of the same shape as ``x`` (bool or 0/1 float); masked-out
entries never contribute, whatever value they hold (NaN included). Reductions accumulate in at least
float32, so bfloat16 inputs give float32 results. An empty selection gives 0 (not NaN): the count in
a denominator is clamped to 1, which keeps gradients finite for fully padded rows.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

Axis = int | tuple[int, ...] | None


def assert_same_shape(**arrays: ArrayLike) -> None:
    """Raise ``AssertionError`` (at trace time) unless all named arrays share one shape.

    The message names every array and its shape, e.g. ``values=(4, 8), mask=(4, 7)``.
    """
    named = ", ".join(f"{k}={jnp.shape(v)}" for k, v in arrays.items())
    chex.assert_equal_shape(
        list(arrays.values()), custom_message=f"arrays must share one shape: {named}"
    )


def at_least_float32(x: ArrayLike) -> Array:
    """``x`` as an array in at least float32 (bfloat16 -> float32, float64 stays)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_inputs(mask: ArrayLike, **arrays: ArrayLike) -> tuple[Array, ...]:
    """Check that ``mask`` and every named array are ``[N, T]`` of one shape (the message names
    them), then return the arrays in at least float32 and 0 where ``mask`` is off, and the mask
    as bool: ``(*arrays, mask)``."""
    assert_same_shape(mask=mask, **arrays)
    chex.assert_rank(mask, 2, custom_message=f"mask must be [N, T], got {jnp.shape(mask)}")
    m = jnp.asarray(mask).astype(bool)
    return (*(jnp.where(m, at_least_float32(a), 0.0) for a in arrays.values()), m)


def last_valid_index(mask: Bool[Array, "*b t"]) -> Int[Array, "*b"]:
    """Index of the last True along the last axis; -1 where there is none."""
    n = jnp.shape(mask)[-1]
    return jnp.max(
        jnp.where(jnp.asarray(mask).astype(bool), jnp.arange(n, dtype=jnp.int32), -1), axis=-1
    )


def _select(x: ArrayLike, mask: ArrayLike) -> tuple[Array, Array]:
    """``(x where mask else 0, mask as float)``, both in the accumulation dtype."""
    assert_same_shape(x=x, mask=mask)
    x = at_least_float32(x)
    m = jnp.asarray(mask).astype(bool)
    return jnp.where(m, x, 0.0), m.astype(x.dtype)


def masked_sum(
    x: Float[Array, "*s"], mask: Bool[Array, "*s"], axis: Axis = None
) -> Float[Array, "..."]:
    """``sum_i m_i x_i`` over ``axis`` (all axes when None)."""
    xs, _ = _select(x, mask)
    return xs.sum(axis=axis)


def masked_count(mask: Bool[Array, "*s"], axis: Axis = None) -> Float[Array, "..."]:
    """``sum_i m_i`` as float32."""
    return jnp.asarray(mask).astype(jnp.float32).sum(axis=axis)


def masked_mean(
    x: Float[Array, "*s"], mask: Bool[Array, "*s"], axis: Axis = None
) -> Float[Array, "..."]:
    """``sum_i m_i x_i / max(sum_i m_i, 1)`` over ``axis``; 0 where nothing is selected."""
    xs, m = _select(x, mask)
    return xs.sum(axis=axis) / jnp.maximum(m.sum(axis=axis), 1.0)


def masked_var(
    x: Float[Array, "*s"], mask: Bool[Array, "*s"], axis: Axis = None, *, unbiased: bool = True
) -> Float[Array, "..."]:
    """Masked variance ``sum_i m_i (x_i - mu)^2 / d`` with ``mu = masked_mean(x, mask)``.

    ``d = max(n - 1, 1)`` when ``unbiased`` (Bessel; torch's ``std()`` default, used by TRL and
    verl's ``masked_var``), else ``d = max(n, 1)``. Differs from verl, which raises for ``n <= 1``:
    a single selected element has variance 0 here so the function stays jittable.
    """
    xs, m = _select(x, mask)
    n = m.sum(axis=axis, keepdims=True)
    mu = xs.sum(axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
    sq = jnp.where(m > 0, (xs - mu) ** 2, 0.0).sum(axis=axis, keepdims=True)
    denom = jnp.maximum(n - 1.0, 1.0) if unbiased else jnp.maximum(n, 1.0)
    var = sq / denom
    return var.reshape(jnp.shape(xs.sum(axis=axis)))


def masked_std(
    x: Float[Array, "*s"], mask: Bool[Array, "*s"], axis: Axis = None, *, unbiased: bool = True
) -> Float[Array, "..."]:
    """``sqrt(masked_var(x, mask, axis, unbiased=unbiased))`` (gradient undefined where it is 0)."""
    return jnp.sqrt(masked_var(x, mask, axis, unbiased=unbiased))


def masked_whiten(
    x: Float[Array, "*s"],
    mask: Bool[Array, "*s"],
    axis: Axis = None,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Float[Array, "*s"]:
    """``(x - mu) / sqrt(var + eps)`` with masked mean and unbiased masked variance (TRL/verl).

    With ``shift_mean=False`` the mean is added back: ``(x - mu) / sqrt(var + eps) + mu``.
    Statistics are over ``axis`` (all axes when None). Unlike TRL/verl, masked-out entries of
    the result are 0, so padding never carries values forward.
    """
    xs, m = _select(x, mask)
    mu = masked_mean(xs, m, axis=axis)
    var = masked_var(xs, m, axis=axis, unbiased=True)
    if axis is not None:
        mu, var = jnp.expand_dims(mu, axis), jnp.expand_dims(var, axis)
    out = (xs - mu) * jnp.reciprocal(jnp.sqrt(var + eps))
    if not shift_mean:
        out = out + mu
    return jnp.where(m > 0, out, 0.0)
