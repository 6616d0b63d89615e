"""The training state that flows through a GRPO step."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from relax.models.transformer import Transformer


class TrainState(eqx.Module):
    """Policy, optimizer state, reference model (None when no KL term needs it), the number of
    completed GRPO iterations, the PRNG key, and running statistics for reference resets."""

    policy: Transformer
    opt_state: optax.OptState
    ref: Transformer | None
    step: Int[Array, ""]
    key: Array
    running_kl: Array
    running_entropy: Array

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


def init_state(policy: Transformer, optimizer: optax.GradientTransformation, *, key: Array,
               with_reference: bool) -> TrainState:
    """Fresh state; the reference starts as a copy of the policy when one is needed."""
    ref = jax.tree.map(jnp.copy, policy) if with_reference else None
    return TrainState(policy=policy, opt_state=optimizer.init(policy), ref=ref, step=jnp.int32(0), key=key,
                      running_kl=jnp.float32(0.0), running_entropy=jnp.float32(0.0))
