"""The training state: shared parts that each algorithm assembles (docs/architecture.md, "State").

Every trainer's state has a ``policy`` (what samples, is evaluated and exported), its optimizer
state, the number of completed iterations and the PRNG key. The other parts are there only
when the algorithm uses them (None is an empty pytree: nothing is stored or checkpointed):

- ``ref``: the KL reference model (GRPO with ``beta > 0``, PPO with ``kl_coef > 0``);
- ``ref_stats``: running statistics the ProRL reference resets read;
- ``critic`` and ``critic_opt_state``: PPO's value model (a ``Critic`` with its own backbone, or a
  ``ValueHead`` on the policy's backbone) and its optimizer state.

The optimizers are static fields (``optimizer``, ``critic_optimizer``): ``optim_step`` needs no
other argument, and jit specialises on them like on any static configuration.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from relax.objectives.reference import RunningStats


class TrainState(eqx.Module):
    policy: eqx.Module
    opt_state: optax.OptState
    step: Int[Array, ""]
    key: Array
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    ref: eqx.Module | None = None
    ref_stats: RunningStats | None = None
    critic: eqx.Module | None = None
    critic_opt_state: optax.OptState | None = None
    critic_optimizer: optax.GradientTransformation | None = eqx.field(static=True, default=None)

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


def init_state(policy: eqx.Module, optimizer: optax.GradientTransformation, *, key: Array,
               with_reference: bool = False, with_ref_stats: bool = False, critic: eqx.Module | None = None,
               critic_optimizer: optax.GradientTransformation | None = None) -> TrainState:
    """A fresh state; the reference starts as a copy of the policy when one is needed."""
    if (critic is None) != (critic_optimizer is None):
        raise ValueError("a critic needs a critic_optimizer and the other way round")
    return TrainState(
        policy=policy, opt_state=optimizer.init(policy), step=jnp.int32(0), key=key, optimizer=optimizer,
        ref=jax.tree.map(jnp.copy, policy) if with_reference else None,
        ref_stats=RunningStats.zeros() if with_ref_stats else None,
        critic=critic, critic_opt_state=None if critic is None else critic_optimizer.init(critic),
        critic_optimizer=critic_optimizer)
