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
    and its metrics with ``loss`` added.

    Args:
        state: the ``TrainState``; its ``policy`` is differentiated.
        batch: any pytree; passed to ``loss_fn`` as it is.
        loss_fn: ``loss_fn(policy, batch) -> (scalar loss, metrics dict)``.

    Returns:
        ``(grads, metrics)``: ``grads`` shaped like the policy (None at frozen leaves), ready for
            ``optim_step``; ``metrics`` the loss's own, plus ``loss``.
    """
    trained, frozen = split_trainable(state.policy)
    loss_of = lambda t: loss_fn(eqx.combine(t, frozen), batch)  # noqa: E731
    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trained)
    return grads, {**metrics, "loss": loss}


def optim_step(state: TrainState, grads: Any) -> TrainState:
    """One step of the state's optimizer (clipping and the non-finite guard included when it has
    them, see ``relax.train.optimizer``); ``state.step`` counts it.

    Args:
        state: the ``TrainState``; its ``optimizer`` and ``opt_state`` make the update.
        grads: the gradient of the policy's trainable leaves (``forward_backward``'s).

    Returns:
        The new ``TrainState``: the policy updated, the new optimizer state, ``step + 1``; ``key``
            unchanged.
    """
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
    (``relax.rollout.sampler.pad_to_bucket``) so that nearby lengths share one compiled sampler.

    Args:
        state: the ``TrainState``; its ``policy`` samples.
        prompt_ids: int ``[p lp]`` prompt tokens, left-padded.
        prompt_mask: int ``[p lp]``, 1 at the prompt tokens.
        cfg: the sampler's ``RolloutConfig``: completions per prompt, budget, sampling, stop and
            pad tokens.
        key: the PRNG key. None (default): ``fold_in(state.key, state.step)``.

    Returns:
        A ``Rollout``: ``tokens``, ``mask`` and ``logprobs`` ``[p g n]`` (``g`` =
            ``cfg.num_generations``, ``n`` = ``cfg.max_new_tokens``), ``lengths`` and ``finished``
            ``[p g]``, and ``routes`` when ``cfg.record_routes`` and the model has experts.
    """
    if key is None:
        key = jax.random.fold_in(state.key, state.step)
    return compiled_generate(cfg)(state.policy, prompt_ids, prompt_mask, key)


def policy_logprobs(
    policy, batch: Mapping[str, Array], *, temperature: float = 1.0
) -> Float[Array, "p g n"]:
    """Differentiable log-probs of ``batch["tokens"]`` ``[P, G, N]`` after their prompts
    (``prompt_ids`` / ``prompt_mask`` ``[P, Lp]``, ``mask``): what a ``loss_fn`` calls.

    Args:
        policy: the model (a ``Transformer``).
        batch: a mapping with ``prompt_ids`` and ``prompt_mask`` ``[p lp]`` (left-padded),
            ``tokens`` and ``mask`` ``[p g n]`` (the completions, right after their prompt).
        temperature: the logits are divided by it (default 1.0); use the sampler's to compare
            with its log-probs.

    Returns:
        float32 ``[p g n]`` log-probs of ``batch["tokens"]``; values where ``mask`` is 0 are
            meaningless.
    """
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
    old-policy log-probs, or compare with the sampler's).

    Args:
        state: the ``TrainState``; its ``policy`` scores the batch.
        batch: as ``policy_logprobs``'s.
        temperature: as ``policy_logprobs``'s (default 1.0).

    Returns:
        ``policy_logprobs``' ``[p g n]`` log-probs under a stop-gradient.
    """
    return jax.lax.stop_gradient(policy_logprobs(state.policy, batch, temperature=temperature))
