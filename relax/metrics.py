"""Metrics with declared reductions.

A loss returns ``(loss, metrics)``; the update runs it over micro-batches, optimizer steps and
epochs and must reduce each metric to one value. How is the metric's own business, declared
where it is computed, never guessed from its name::

    metrics = {"kl": masked_mean(kl, mask),            # a plain array: "mean"
               "ratio_max": Metric(r_max, "max")}

Reductions (over the stacked values ``x_1..x_n`` of micro-batches, then of optimizer steps):

    mean         sum_i w_i x_i / sum_i w_i over micro-batches (``w_i``: each micro-batch's loss
                 tokens, so a micro-batch's masked mean counts as its tokens; plain mean when
                 every w_i is 0), plain mean over optimizer steps
    sum          sum_i x_i
    share        a micro-batch's share of its step's total (a loss term under the step's global
                 normalisers): sum_i x_i over micro-batches, plain mean over optimizer steps, so
                 the value does not change with gradient accumulation (as the step's ``loss``)
    max / min    max_i x_i / min_i x_i
    first_step   over micro-batches ``max``, over optimizer steps the first step's value (e.g. the
                 sampler/trainer log-prob gap, meaningful only before the first step)
    first_mean   over micro-batches ``mean`` (weighted), over optimizer steps the first step's
                 value: the weighted mean over the first step's micro-batches (e.g. the mean
                 sampler/trainer mismatch, ``relax.objectives.mismatch``)
    first_found  the first x_i >= 0, else -1 (an index found by some step, e.g. the first
                 non-finite gradient leaf)

A ``mean`` or ``first_mean`` metric may carry its own micro-batch weight, ``Metric(x, "mean",
weight=n)`` (e.g. ``n`` its micro-batch's sequences for a mean over sequences): ``w_i`` is then
``n_i`` instead of the loss tokens, so the value is that mean over the whole step exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

REDUCTIONS = ("mean", "sum", "share", "max", "min", "first_step", "first_mean", "first_found")
WEIGHTED = ("mean", "first_mean")  # the reductions that read a micro-batch weight


class Metric(eqx.Module):
    """A metric value and how it is reduced (static: part of the pytree structure); ``weight``:
    its micro-batch weight in a ``mean`` / ``first_mean`` (None: the micro-batch's loss tokens)."""

    value: Array
    reduction: str = eqx.field(static=True, default="mean")
    weight: Array | None = None

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype=dtype)

    def __float__(self) -> float:
        return float(self.value)

    def __check_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"unknown metric reduction {self.reduction!r}; valid: {', '.join(REDUCTIONS)}"
            )
        if self.weight is not None and self.reduction not in WEIGHTED:
            raise ValueError(
                f"a metric weight is read by the reductions {', '.join(WEIGHTED)} only, "
                f"not by {self.reduction!r}"
            )


Metrics = Mapping[str, "Array | Metric"]


def declare(metrics: Metrics, reductions: Mapping[str, str]) -> dict[str, Metric]:
    """``metrics`` with the named entries wrapped in their declared reductions (others: mean)."""
    unknown = sorted(set(reductions) - set(metrics))
    if unknown:
        raise KeyError(f"reductions declared for metrics that are not there: {', '.join(unknown)}")
    return {k: as_metric(v, reductions.get(k, "mean")) for k, v in metrics.items()}


def as_metric(x: Array | Metric, reduction: str = "mean") -> Metric:
    return x if isinstance(x, Metric) else Metric(jnp.asarray(x), reduction)


def _reduce(m: Metric, weights: Array | None, level: str) -> Metric:
    x, r = m.value, m.reduction
    weights = weights if m.weight is None else m.weight
    if r == "sum" or (r == "share" and level == "micro"):
        out = jnp.sum(x)
    elif r == "share":
        out = jnp.mean(x)
    elif r == "max" or (r == "first_step" and level == "micro"):
        out = jnp.max(x)
    elif r == "min":
        out = jnp.min(x)
    elif r in ("first_step", "first_mean") and level == "steps":
        out = x.reshape(-1)[0]
    elif r == "first_found":
        x = x.reshape(-1)
        out = jnp.where(jnp.any(x >= 0), x[jnp.argmax(x >= 0)], -1).astype(x.dtype)
    elif weights is None:
        out = jnp.mean(x)
    else:
        w = weights.astype(x.dtype)
        total = jnp.sum(w)
        out = jnp.where(total > 0, jnp.sum(w * x) / jnp.where(total > 0, total, 1), jnp.mean(x))
    return Metric(out, r)


def neutral(m: Metric) -> Metric:
    """A metric (or its ``jax.eval_shape``) with the value that leaves its reduction unchanged
    over micro-batches and a zero weight: what a skipped micro-batch reports."""
    value = m.value
    dtype = jnp.dtype(value.dtype)
    low, high = (
        (jnp.iinfo(dtype).min, jnp.iinfo(dtype).max)
        if jnp.issubdtype(dtype, jnp.integer)
        else (-jnp.inf, jnp.inf)
    )
    fill = {"max": low, "first_step": low, "min": high, "first_found": -1}.get(m.reduction, 0)
    weight = None if m.weight is None else jnp.zeros(m.weight.shape, m.weight.dtype)
    return Metric(jnp.full(value.shape, fill, dtype), m.reduction, weight)


def reduce_micro(metrics: Mapping[str, Metric], weights: Array) -> dict[str, Metric]:
    """Metrics stacked over a step's micro-batches (leading axis) -> the step's metrics."""
    return {k: _reduce(m, weights, "micro") for k, m in metrics.items()}


def reduce_steps(metrics: Mapping[str, Metric]) -> dict[str, Metric]:
    """Metrics stacked over optimizer steps (any leading axes, in step order) -> one value each."""
    return {k: _reduce(m, None, "steps") for k, m in metrics.items()}


def values(metrics: Mapping[str, Array | Metric]) -> dict[str, Array]:
    """Plain arrays, the reductions dropped (for logging)."""
    return {k: m.value if isinstance(m, Metric) else m for k, m in metrics.items()}
