"""The GRPO-family loss on one micro-batch of prompt groups, for ``relax.train.update``.

Per valid completion token: the policy loss ``cfg.policy_loss`` (a registry loss,
``relax.objectives.registry``) against the old (sampling) policy, plus ``beta * KL`` to the
reference (or Signal's conservative penalty, or nothing here
when the KL is in the reward), minus ``entropy_coef * H``; aggregated by ``cfg.loss_type``
with the batch-wide normalisers of ``ctx.norms``::

    loss = aggregate(pg_t + beta * KL_t - c_H * H_t;  tokens = ctx.norms["tokens"],
                     sequences = ctx.norms["sequences"])

While the policy is bitwise the reference (``ctx.ref_is_policy``) the reference log-probs are
the policy's own under a stop-gradient: ``KL_t = 0`` and its gradient is 0 (``relax.train.update``).

On a stale batch (``off_policy``, ``relax.objectives.off_policy``) the policy loss clips against
the proximal policy, the trainer's weights when the update starts, and is weighted by the
detached behaviour weight ``w_t`` of the sampler's log-probs::

    pg_t = w_t * policy_loss(logp_t, prox_t, A_t)

``prox_t`` is ``sg(logp_t)`` when the update is one optimizer step (the weights the loss sees ARE
the proximal policy), else the batch's ``prox_logprobs`` (``relax.algorithms.online.stages.make_proximal``).

The ``mismatch/*`` metrics (``relax.objectives.mismatch``) compare ``logp_t`` with the sampler's
``old_t``, at the update's first optimizer step: the numerics' gap (precision, quantized
sampler) on a fresh batch; on a stale one (with a correction: ``old_t`` is the behaviour policy,
``logp_t`` the proximal weights) the staleness too, as verl's ``rollout_corr`` metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.online.batch import LossRows
from relax.algorithms.online.binned import make_binned_update
from relax.algorithms.online.stages import train_logprobs
from relax.masked import masked_mean
from relax.models.forward.prefix_shared import completion_rope
from relax.objectives.aggregation import aggregate
from relax.objectives.kl import conservative_penalty, entropy_bonus, kl_estimate
from relax.objectives.mismatch import mismatch_metrics
from relax.objectives.off_policy import OffPolicyConfig, corrected_loss
from relax.objectives.registry import as_policy_loss
from relax.passes import Passes
from relax.train.update import LossContext, SideInputs, make_update, token_share


def make_loss(
    cfg: GRPOConfig, passes: Passes = Passes(), off_policy: OffPolicyConfig | None = None
):
    """``loss(policy, micro_batch, ctx) -> (scalar, metrics)`` for one micro-batch of groups;
    ``off_policy``: the behaviour correction of stale batches (None: the batch is on-policy)."""
    policy_loss = as_policy_loss(cfg.policy_loss)

    def loss_fn(policy, mb: LossRows, ctx: LossContext):
        p, g, n = mb.tokens.shape
        logp, ent, router, router_metrics = train_logprobs(
            policy,
            mb,
            passes,
            cfg.forward,
            temperature=cfg.generation.temperature,
            entropy_grad=cfg.entropy_coef != 0.0,
        )
        flat = lambda x: x.reshape(p * g, n)  # noqa: E731
        logp, ent, mask, old = (
            flat(logp),
            flat(ent),
            flat(mb.loss_mask).astype(bool),
            flat(mb.old_logprobs),
        )
        adv = mb.advantages.reshape((p * g,) + mb.advantages.shape[2:])  # [B] or [B, N]
        if off_policy is None:
            per_token, metrics = policy_loss(logp, old, adv, mask)
            metrics = dict(metrics)
        else:
            per_token, metrics = corrected_loss(
                policy_loss,
                logp,
                old,
                adv,
                mask,
                off_policy,
                None if mb.prox_logprobs is None else flat(mb.prox_logprobs),
            )
        if cfg.beta > 0:
            # masked inside (inputs zeroed first): no inf/NaN from padding reaches the gradient
            ref = jnp.where(ctx.ref_is_policy, jax.lax.stop_gradient(logp), flat(mb.ref_logprobs))
            kl = kl_estimate(logp, ref, cfg.kl_estimator, mask=mask)
            metrics["kl"] = masked_mean(kl, mask)
            if cfg.kl_threshold is not None:  # Signal's one-sided conservative penalty
                per_token = per_token + jnp.where(
                    mask, conservative_penalty(kl, threshold=cfg.kl_threshold, coef=cfg.beta), 0.0
                )
            elif not cfg.kl_in_reward:
                per_token = per_token + cfg.beta * kl
        if cfg.entropy_coef != 0.0:
            per_token = per_token + entropy_bonus(ent, mask, coef=cfg.entropy_coef)
        metrics["entropy"] = masked_mean(ent, mask)
        metrics.update(mismatch_metrics(logp, old, mask))  # the first optimizer step's
        loss = aggregate(
            per_token,
            mask,
            cfg.loss_type,
            num_sequences=ctx.norms["sequences"],
            num_tokens=ctx.norms["tokens"],
            max_len=cfg.generation.max_new_tokens,
        )
        return loss + token_share(router, mask, ctx), {**metrics, **router_metrics}

    return loss_fn


def make_grpo_update(
    cfg: GRPOConfig,
    optimizer,
    passes: Passes = Passes(),
    off_policy: OffPolicyConfig | None = None,
    side: SideInputs | None = None,
):
    """``update(policy, opt_state, data, key, ref_is_policy=False, side_data=None) -> (policy,
    opt_state, metrics)``: the generic update (``relax.train.update``) of ``make_loss(cfg)`` with
    the config's epochs, minibatches and micro-batches, on ``LossRows`` (``rope`` filled here);
    over its bins when the batch was packed (``relax.algorithms.online.binned``). ``side``: the
    prompts' features made by a trained vision tower (``relax.algorithms.online.vision``); the
    ``policy`` is then ``(policy, vision)``."""
    loss = make_loss(cfg, passes, off_policy)
    split = dict(epochs=cfg.num_iterations, minibatches=cfg.num_minibatches, passes=passes)
    update = make_update(
        loss, optimizer, grad_accum=cfg.grad_accum, track_reference=cfg.beta > 0, side=side, **split
    )
    binned = make_binned_update(loss, optimizer, track_reference=cfg.beta > 0, **split)

    def grpo_update(policy, opt_state, data: LossRows, key, ref_is_policy=False, side_data=None):
        config = (policy if side is None else policy[0]).config
        if data.packed is not None and side is not None:
            raise ValueError("a trained tower's image prompts run padded, never packed")
        if data.packed is not None:
            return binned(policy, opt_state, data, key, ref_is_policy, config=config)
        _, g, n = data.tokens.shape
        # rotary tables once for all epochs and micro-batches, outside their loops (see completion_rope)
        rope = completion_rope(config, data.prompt_mask, g, n, data.images)
        data = data.replace(rope=rope)
        return update(policy, opt_state, data, key, ref_is_policy, side_data)

    return grpo_update
