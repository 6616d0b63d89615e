"""The training state: shared parts that each algorithm assembles (docs/architecture.md, "State").

Every trainer's state has a ``policy`` (what samples, is evaluated and exported), its optimizer
state, the number of completed iterations and the PRNG key. The other parts are there only
when the algorithm uses them (None is an empty pytree: nothing is stored or checkpointed):

- ``ref``: the KL reference model (GRPO with ``beta > 0``, PPO with ``kl_coef > 0``). A policy
  with LoRA adapters has none: its reference is its base, the policy with the adapters off
  (``ref_is_base``; ``reference_model`` gives either);
- ``ref_stats``: running statistics the ProRL reference resets read;
- ``critic`` and ``critic_opt_state``: PPO's value model (a ``Critic`` with its own backbone, or a
  ``ValueHead`` on the policy's backbone) and its optimizer state;
- ``vision``: a vision-language policy's trained vision part (``--train-vision``), trained by the
  policy's optimizer with it: ``opt_state`` is then over ``(policy, vision)``'s trainable leaves
  (``trained_params``). None: the vision part is frozen, outside the state.

An optimizer sees only the trainable leaves (``relax.models.adapters.operations.trainable``: the adapters
of a LoRA policy, every weight otherwise), so a LoRA policy's optimizer state holds adapter
moments only. The optimizers are static fields (``optimizer``, ``critic_optimizer``): ``optim_step`` needs no
other argument, and jit specialises on them like on any static configuration.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Int

from relax.models.adapters.operations import adapters_zero, has_lora, lora_off, split_trainable
from relax.objectives.reference import RunningStats, params_equal


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
    ref_is_base: bool = eqx.field(static=True, default=False)
    vision: eqx.Module | None = None

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


def init_state(
    policy: eqx.Module,
    optimizer: optax.GradientTransformation,
    *,
    key: Array,
    with_reference: bool = False,
    with_ref_stats: bool = False,
    critic: eqx.Module | None = None,
    critic_optimizer: optax.GradientTransformation | None = None,
    vision: eqx.Module | None = None,
) -> TrainState:
    """A fresh state; when a reference is needed it starts as a copy of the policy, or for a
    policy with LoRA adapters is the policy's own base (no copy, ``ref_is_base``).

    Args:
        policy: the model to train (what samples, is evaluated and exported).
        optimizer: the policy's optax optimizer; it sees only the trainable leaves.
        key: the PRNG key the steps split.
        with_reference: give the state a KL reference (default False): a copy of ``policy``, or
            for a policy with LoRA adapters its own base.
        with_ref_stats: give the state zeroed ``ref_stats`` (default False), the running
            statistics the ProRL reference resets read.
        critic: a value model (PPO's ``Critic`` or ``ValueHead``). None (default): none.
        critic_optimizer: the critic's optax optimizer; given exactly when ``critic`` is.
        vision: a vision part to train with the policy, by ``optimizer`` (default None).

    Returns:
        A ``TrainState`` with ``step`` 0, the optimizers' fresh states, and ``ref``, ``ref_stats``,
            ``critic`` and ``critic_opt_state`` None unless asked for.
    """
    if (critic is None) != (critic_optimizer is None):
        raise ValueError("a critic needs a critic_optimizer and the other way round")
    base_ref = with_reference and has_lora(policy)
    return TrainState(
        policy=policy,
        opt_state=optimizer.init(split_trainable(trained_params(policy, vision))[0]),
        step=jnp.int32(0),
        key=key,
        optimizer=optimizer,
        ref=jax.tree.map(jnp.copy, policy) if with_reference and not base_ref else None,
        ref_stats=RunningStats.zeros() if with_ref_stats else None,
        critic=critic,
        critic_opt_state=None
        if critic is None
        else critic_optimizer.init(split_trainable(critic)[0]),
        critic_optimizer=critic_optimizer,
        ref_is_base=base_ref,
        vision=vision,
    )


def trained_params(policy, vision=None):
    """What the policy's optimizer trains: ``policy``, or ``(policy, vision)`` with a trained
    vision part (``relax.train.update``'s params with a ``side`` part)."""
    return policy if vision is None else (policy, vision)


def policy_and_vision(params, state: TrainState):
    """``(policy, vision)`` of an update's ``params`` (``trained_params`` of ``state``'s): the
    vision part None when the state trains none."""
    return (params, None) if state.vision is None else params


def reference_model(state: TrainState) -> eqx.Module | None:
    """The reference model: ``state.ref``, or the policy with its adapters off (``ref_is_base``)."""
    return lora_off(state.policy) if state.ref is None and state.ref_is_base else state.ref


def reference_is_policy(state: TrainState, *, smallest_first: bool = False) -> Bool[Array, ""]:
    """Whether the policy is bitwise its reference: equal parameters, or adapters all at ``B = 0``."""
    if state.ref is None and state.ref_is_base:
        return adapters_zero(state.policy)
    return params_equal(state.ref, state.policy, smallest_first=smallest_first)


def apply_updates(params, updates):
    """``params`` with optimizer ``updates`` of their trainable part applied (the rest as is)."""
    trained, frozen = split_trainable(params)
    return eqx.combine(optax.apply_updates(trained, updates), frozen)
