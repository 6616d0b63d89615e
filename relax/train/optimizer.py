"""The optimizer every trainer uses: global-norm clipping -> AdamW on a schedule, non-finite
steps skipped (``optax.apply_if_finite``), optional float32 master weights (all optax)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from relax.choices import check_choice

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warm-up + schedule (all optax)."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000  # for the cosine / linear decay
    master_weights: bool = False
    """Keep float32 master weights in the optimizer state (for bfloat16 params: rollout and
    forward run on the bf16 policy, updates accumulate in float32; see ``with_master_weights``)."""

    def __post_init__(self):
        check_choice("schedule", self.schedule, SCHEDULES)
        # a NaN rate poisons every weight at the first step (apply_if_finite checks the gradients,
        # not the step), a negative one trains the wrong way, zero trains nothing
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"the optimizer's learning_rate must be finite and > 0, got {self.learning_rate}"
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"the optimizer's weight_decay must be finite and >= 0, got {self.weight_decay}"
            )
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0):
            raise ValueError(
                f"the optimizer needs 0 <= b1, b2 < 1 and eps > 0, got b1={self.b1}, b2={self.b2}, "
                f"eps={self.eps}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"the optimizer's max_grad_norm must be > 0 or None, got {self.max_grad_norm}"
            )
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"warmup_steps >= 0 and total_steps >= 1 are required, got {self.warmup_steps}, "
                f"{self.total_steps}"
            )

    def learning_rate_schedule(self) -> optax.Schedule:
        lr = self.learning_rate
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        if self.schedule == "constant":
            main = optax.constant_schedule(lr)
        elif self.schedule == "cosine":
            main = optax.cosine_decay_schedule(lr, decay_steps)
        else:
            main = optax.linear_schedule(lr, 0.0, decay_steps)
        if self.warmup_steps == 0:
            return main
        warm = optax.linear_schedule(0.0, lr, self.warmup_steps)
        return optax.join_schedules([warm, main], [self.warmup_steps])

    def make(self) -> optax.GradientTransformation:
        """clip -> adamw(schedule); non-finite updates are skipped (``optax.apply_if_finite``)."""
        parts = (
            [] if self.max_grad_norm is None else [optax.clip_by_global_norm(self.max_grad_norm)]
        )
        parts.append(
            optax.adamw(
                self.learning_rate_schedule(),
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
            )
        )
        opt = optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=1_000_000)
        # outside apply_if_finite, so that its skip branch sees float32 updates like its update branch
        return with_master_weights(opt) if self.master_weights else opt


class MasterWeightsState(NamedTuple):
    master: Any  # float32 copy of the parameters (same pytree type, so sharded like them)
    inner: optax.OptState

    @property
    def total_notfinite(self):
        """The inner ``apply_if_finite`` counter (what ``opt_state.total_notfinite`` reads)."""
        return self.inner.total_notfinite

    @property
    def notfinite_count(self):
        """The inner ``apply_if_finite`` streak of skipped steps."""
        return self.inner.notfinite_count


def with_master_weights(
    inner: optax.GradientTransformation, dtype=jnp.float32
) -> optax.GradientTransformation:
    """Run ``inner`` on a float32 master copy of the parameters kept in the optimizer state.

    Gradients (computed on the low-precision params) are cast to float32, ``inner`` updates the
    master weights (its moments are float32 too), and the returned updates take each param
    EXACTLY to its master value rounded to the param dtype: ``apply_updates(params, updates) ==
    master.astype(params.dtype)``. So steps smaller than a bfloat16 ulp are not lost.
    """

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.promote_types(p.dtype, dtype)), params)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_master_weights needs params in update()")
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, state.master)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # float32 updates: apply_updates adds them in float32 and rounds once, to the master value
        out = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(m.dtype) - p.astype(m.dtype), master, params
        )
        return out, MasterWeightsState(master, inner_state)

    return optax.GradientTransformation(init, update)


def skip_counts(opt_state) -> tuple[jax.Array, jax.Array]:
    """``(total, consecutive)`` optimizer steps skipped for non-finite gradients, read from the
    ``optax.apply_if_finite`` states inside ``opt_state`` (the largest where there are several,
    e.g. ``paired``; zeros for an optimizer without one)."""

    def largest(name):
        found = [x for _, x in optax.tree_utils.tree_get_all_with_path(opt_state, name)]
        return functools.reduce(jnp.maximum, found) if found else jnp.int32(0)

    return largest("total_notfinite"), largest("notfinite_count")


def paired(
    first: optax.GradientTransformation, second: optax.GradientTransformation
) -> optax.GradientTransformation:
    """One optimizer for a pair of parameter trees ``(a, b)``: ``first`` updates ``a``, ``second``
    updates ``b``, each with its own state (the pair of states), e.g. a policy and the value
    head on its backbone trained by one joint loss with their own learning rates."""

    def init(params):
        return first.init(params[0]), second.init(params[1])

    def update(grads, state, params=None):
        pa, pb = (None, None) if params is None else params
        ua, sa = first.update(grads[0], state[0], pa)
        ub, sb = second.update(grads[1], state[1], pb)
        return (ua, ub), (sa, sb)

    return optax.GradientTransformation(init, update)
