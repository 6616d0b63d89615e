"""Primitives for research code (Tinker-style): the pieces of a training step, pure and jittable,
with the loop left to the caller (docs/architecture.md, "Primitives"; README, "Your own training loop").

    grads, metrics = forward_backward(state, batch, loss_fn)   # d loss / d policy
    state = optim_step(state, grads)                           # the state's optimizer, step + 1
    rollout = sample(state, prompt_ids, prompt_mask, cfg)      # G completions per prompt
    logp = logprobs(state, batch)                              # [P, G, N] trainer log-probs

``loss_fn(policy, batch) -> (scalar, metrics)``. The trainers (``relax.algorithms``) run the same
computations inside ``relax.train.update``, which adds epochs, minibatches, gradient
accumulation with batch-wide normalisers and declared metric reductions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float

from relax.models.adapters.operations import split_trainable
from relax.models.forward.prefix_shared import completion_logprobs
from relax.rollout.sampler import Rollout, RolloutConfig, compiled_generate
from relax.train.state import TrainState, apply_updates

LossFn = Callable[[Any, Any], "tuple[Array, Mapping[str, Array]]"]


def forward_backward(
    state: TrainState, batch: Any, loss_fn: LossFn
) -> tuple[Any, dict[str, Array]]:
    """``(grads, metrics)``: the gradient of ``loss_fn(state.policy, batch)`` with respect to the
    policy's trainable leaves (the policy's pytree, None at frozen leaves: a LoRA policy's base),
    and its metrics with ``loss`` added."""
    trained, frozen = split_trainable(state.policy)
    loss_of = lambda t: loss_fn(eqx.combine(t, frozen), batch)  # noqa: E731
    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trained)
    return grads, {**metrics, "loss": loss}


def optim_step(state: TrainState, grads: Any) -> TrainState:
    """One step of the state's optimizer (clipping and the non-finite guard included when it has
    them, see ``relax.train.optimizer``); ``state.step`` counts it."""
    updates, opt_state = state.optimizer.update(
        grads, state.opt_state, split_trainable(state.policy)[0]
    )
    return state.replace(
        policy=apply_updates(state.policy, updates), opt_state=opt_state, step=state.step + 1
    )


def sample(
    state: TrainState, prompt_ids, prompt_mask, cfg: RolloutConfig, key: jax.Array | None = None
) -> Rollout:
    """``cfg.num_generations`` completions of each left-padded prompt by the policy (the
    prefix-shared sampler, jitted once per ``cfg``); ``key`` defaults to one derived from
    ``state.key`` and ``state.step``. The prompts are used as given, neither validated nor padded
    (``relax.rollout.sampler.generate_with`` does both): pad them to one of ``cfg.prompt_buckets``
    (``relax.rollout.sampler.pad_to_bucket``) so that nearby lengths share one compiled sampler."""
    if key is None:
        key = jax.random.fold_in(state.key, state.step)
    return compiled_generate(cfg)(state.policy, prompt_ids, prompt_mask, key)


def policy_logprobs(
    policy, batch: Mapping[str, Array], *, temperature: float = 1.0
) -> Float[Array, "p g n"]:
    """Differentiable log-probs of ``batch["tokens"]`` ``[P, G, N]`` after their prompts
    (``prompt_ids`` / ``prompt_mask`` ``[P, Lp]``, ``mask``): what a ``loss_fn`` calls."""
    return completion_logprobs(
        policy,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["tokens"],
        batch["mask"],
        temperature=temperature,
    )


def logprobs(
    state: TrainState, batch: Mapping[str, Array], *, temperature: float = 1.0
) -> Float[Array, "p g n"]:
    """The policy's log-probs of the batch's completions (no gradient needed: e.g. to recompute
    old-policy log-probs, or compare with the sampler's)."""
    return jax.lax.stop_gradient(policy_logprobs(state.policy, batch, temperature=temperature))
