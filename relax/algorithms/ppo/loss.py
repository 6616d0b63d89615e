"""PPO's losses on one micro-batch, for ``relax.train.update``: the policy terms of the actor,
the value terms of the critic, or both from one forward (a value head on the policy's backbone)::

    policy terms = aggregate(policy_loss(logp_t, old_t, A_t) - entropy_coef * H_t)
    value terms  = vf_coef * aggregate(0.5 max((V_t - R_t)^2, (V_clip_t - R_t)^2))

aggregated by ``cfg.loss_type`` with the batch-wide normalisers of ``ctx.norms``; on a stale batch
(``off_policy``, ``relax.objectives.off_policy``) the policy loss clips against the proximal
policy and is weighted by the behaviour weight. A mixture of experts adds its router loss to the
actor's (``relax.algorithms.online.stages.train_logprobs``). The policy terms report the
sampler-vs-trainer ``mismatch/*`` metrics (``relax.objectives.mismatch``: the trainer's log-probs
at the update's first optimizer step against ``old_logprobs``, the sampler's, which on a stale
batch are the behaviour policy's: the staleness counts too).
"""

from __future__ import annotations

import dataclasses

from relax import metrics as M
from relax.algorithms.online.batch import LossRows
from relax.algorithms.online.stages import train_logprobs
from relax.algorithms.ppo.batch import CriticRows
from relax.algorithms.ppo.config import PPOConfig
from relax.masked import masked_mean
from relax.models.heads.critic import completion_logprobs_and_values, completion_values
from relax.objectives.aggregation import aggregate
from relax.objectives.kl import entropy_bonus
from relax.objectives.mismatch import mismatch_metrics
from relax.objectives.off_policy import OffPolicyConfig, corrected_loss
from relax.objectives.registry import as_policy_loss
from relax.objectives.value import clipped_value_loss
from relax.passes import Passes
from relax.train.update import LossContext, token_share


def policy_terms(
    cfg: PPOConfig,
    policy_loss,
    logp,
    ent,
    mb,
    ctx: LossContext,
    off_policy: OffPolicyConfig | None = None,
):
    """The registry's policy loss (+ entropy bonus) on ``[P, G, N]`` log-probs, aggregated; on a
    stale batch (``off_policy``) clipped against the proximal policy and weighted
    (``relax.objectives.off_policy.corrected_loss``); with the ``mismatch/*`` metrics of the
    log-probs against the sampler's (``relax.objectives.mismatch``)."""
    p, g, n = mb.tokens.shape
    flat = lambda x: x.reshape(p * g, n)  # noqa: E731
    mask = flat(mb.loss_mask) > 0
    logp, old = flat(logp), flat(mb.old_logprobs)
    args = (logp, old, flat(mb.advantages), mask)
    if off_policy is None:
        per_token, metrics = policy_loss(*args)
    else:
        prox = None if mb.prox_logprobs is None else flat(mb.prox_logprobs)
        per_token, metrics = corrected_loss(policy_loss, *args, off_policy, prox)
    if cfg.entropy_coef != 0.0:
        per_token = per_token + entropy_bonus(flat(ent), mask, coef=cfg.entropy_coef)
    loss = aggregate(
        per_token,
        mask,
        cfg.loss_type,
        num_sequences=ctx.norms["sequences"],
        num_tokens=ctx.norms["tokens"],
        max_len=cfg.generation.max_new_tokens,
    )
    return loss, {
        **metrics,
        **mismatch_metrics(logp, old, mask),
        "entropy": masked_mean(flat(ent), mask),
        "pg_loss": M.Metric(loss, "share"),
    }


def value_terms(cfg: PPOConfig, values, mb, ctx: LossContext):
    """``vf_coef * aggregate(0.5 max((V - R)^2, (V_clip - R)^2))`` on ``[P, G, N]`` values."""
    p, g, n = mb.tokens.shape
    flat = lambda x: x.reshape(p * g, n)  # noqa: E731
    mask = flat(mb.loss_mask) > 0
    per_token, metrics = clipped_value_loss(
        flat(values), flat(mb.old_values), flat(mb.returns), mask, clip_range=cfg.cliprange_value
    )
    loss = cfg.vf_coef * aggregate(
        per_token,
        mask,
        cfg.loss_type,
        num_sequences=ctx.norms["sequences"],
        num_tokens=ctx.norms["tokens"],
        max_len=cfg.generation.max_new_tokens,
    )
    return loss, {
        **metrics,
        "vf_loss": M.Metric(loss, "share"),
        "vpred": masked_mean(flat(values), mask),
    }


def make_actor_loss(cfg: PPOConfig, passes: Passes, off_policy: OffPolicyConfig | None = None):
    """``loss(policy, micro_batch, ctx)``: the policy terms."""
    policy_loss = as_policy_loss(cfg.policy_loss)

    def loss_fn(policy, mb: LossRows, ctx: LossContext):
        logp, ent, router, router_metrics = train_logprobs(
            policy,
            mb,
            passes,
            cfg.forward,
            temperature=cfg.generation.temperature,
            entropy_grad=cfg.entropy_coef != 0.0,
        )
        loss, metrics = policy_terms(cfg, policy_loss, logp, ent, mb, ctx, off_policy)
        return loss + token_share(router, mb.loss_mask > 0, ctx), {**metrics, **router_metrics}

    return loss_fn


def make_critic_loss(cfg: PPOConfig, passes: Passes):
    """``loss(critic, micro_batch, ctx)``: the value terms of a separate critic (reading the
    micro-batch's image prompts, ``mb.images``, when it has them)."""

    def loss_fn(critic, mb: CriticRows, ctx: LossContext):
        values = completion_values(
            critic,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.tokens,
            mb.mask,
            cfg.forward.pass_().laid_out(passes, critic.backbone.config),
            rope=mb.critic_rope,
            packed=mb.packed,
            prompt=mb.images,
        )
        return value_terms(cfg, values, mb, ctx)

    return loss_fn


def make_joint_loss(cfg: PPOConfig, passes: Passes, off_policy: OffPolicyConfig | None = None):
    """``loss((policy, head), micro_batch, ctx) = policy terms + value terms`` from ONE forward of
    the policy (a value head on its backbone: both terms train the backbone)."""
    policy_loss = as_policy_loss(cfg.policy_loss)

    def loss_fn(params, mb: CriticRows, ctx: LossContext):
        policy, head = params
        how = dataclasses.replace(
            cfg.forward.pass_().laid_out(passes, policy.config),
            entropy_grad=cfg.entropy_coef != 0.0,
        )
        logp, ent, values = completion_logprobs_and_values(
            policy,
            head,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.tokens,
            mb.mask,
            how,
            temperature=cfg.generation.temperature,
            rope=mb.rope,
            packed=mb.packed,
            prompt=mb.images,
        )
        pg, metrics = policy_terms(cfg, policy_loss, logp, ent, mb, ctx, off_policy)
        vf, vf_metrics = value_terms(cfg, values, mb, ctx)
        return pg + vf, {**metrics, **{f"critic/{k}": v for k, v in vf_metrics.items()}}

    return loss_fn
