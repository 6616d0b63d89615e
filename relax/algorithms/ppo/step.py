"""The PPO step: ``compose(rollout, score_start, [reference], score_finish, [mc_values], advantage, update)``.

- ``rollout``, ``score_start`` / ``score_finish``, ``reference``: as GRPO's
  (``relax.algorithms.online.stages``; the reward pool scores while the reference forward runs).
- ``mc_values`` (host, VinePPO only): Monte-Carlo state values from branched rollouts
  (``relax.algorithms.ppo.vine``).
- ``advantage`` (jit): per-token rewards with the KL penalty in them, the critic's values of the
  sampled states, GAE (or VinePPO's ``V(s_{t+1}) - V(s_t)``), whitening::

      r_t = score * [t = last valid] - kl_coef * KL_t(old || ref)
      delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t

- ``update`` (jit): the policy loss (``cfg.policy_loss``, ``relax.objectives.registry``) and the
  critic's clipped value loss (``relax.algorithms.ppo.loss``), each through ``relax.train.update``
  on the same minibatch split (a value head on the policy's backbone: one joint loss, one
  forward); the reference rule.

A completion whose score is missing (NaN: every reward function failed for it) is left out of
both losses.

Image prompts (``Prompts.images``, ``PromptInputs``) reach every forward as GRPO's do: the
sampler, the reference, the critic's values and both updates (the actor's, the critic's or the
joint one) run each prompt once per group with its image features, RoPE and blocks; a separate
critic reads the policy's features (``relax.models.heads.critic.check_reads_prompt_inputs``).
VinePPO's branches are text prefixes: it refuses image prompts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.algorithms.online.batch import LossRows, Scored
from relax.algorithms.online.binned import bins_rope, make_binned_update
from relax.algorithms.online.stages import packing_metrics
from relax.algorithms.online.step import OnlineParts, StepParts, make_online_step
from relax.algorithms.online.vision import IMAGE_FEATURES, image_data
from relax.algorithms.ppo.batch import CriticRows, PPOBatch
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.loss import make_actor_loss, make_critic_loss, make_joint_loss
from relax.algorithms.ppo.vine import make_mc_values, step_advantages
from relax.compose import Stage, stage
from relax.masked import last_valid_index, masked_mean
from relax.models.forward.prefix_shared import completion_rope
from relax.models.heads.critic import (
    check_reads_prompt_inputs,
    completion_head_values,
    completion_values,
)
from relax.objectives.advantages import gae, whiten
from relax.objectives.kl import kl_estimate
from relax.objectives.off_policy import OffPolicyConfig
from relax.objectives.reference import make_reference_rule
from relax.objectives.value import explained_variance
from relax.passes import Passes
from relax.train.health import first_nonfinite, step_health
from relax.train.optimizer import paired
from relax.train.state import TrainState
from relax.train.update import Updated, make_update, update_policy


def token_rewards(score, mask, kl, kl_coef: float):
    """``r_t = score * [t = last valid token] - kl_coef * KL_t`` on valid tokens, ``[..., N]``."""
    m = mask > 0
    at_end = jnp.arange(m.shape[-1]) == last_valid_index(m)[..., None]
    return jnp.where(m, jnp.where(at_end, score[..., None], 0.0) - kl_coef * kl, 0.0)


def kl_token_rewards(
    cfg: PPOConfig,
    score: Float[Array, "p g"],
    loss_mask: Int[Array, "p g n"],
    old_logprobs: Float[Array, "p g n"],
    ref_logprobs: Float[Array, "p g n"] | None,
) -> tuple[Float[Array, "p g n"], Float[Array, "p g n"]]:
    """``(r_t, KL_t)``: ``token_rewards`` with ``KL_t = kl_estimate(old || ref)`` (``cfg.kl_estimator``)
    on the loss tokens, 0 everywhere when ``cfg.kl_coef`` is 0 (``ref_logprobs`` unread)."""
    m = loss_mask > 0
    kl = (
        kl_estimate(old_logprobs, ref_logprobs, cfg.kl_estimator, mask=m)
        if cfg.kl_coef > 0
        else jnp.zeros(m.shape, jnp.float32)
    )
    return token_rewards(score, loss_mask, kl, cfg.kl_coef), kl


def gae_terms(
    cfg: PPOConfig,
    token_r: Float[Array, "p g n"],
    values: Float[Array, "p g n"],
    mask: Bool[Array, "p g n"],
) -> tuple[Float[Array, "p g n"], Float[Array, "p g n"], Float[Array, ""]]:
    """GAE's advantages and returns ``R_t = A_t + V_t`` over the valid tokens (``cfg.gamma``,
    ``cfg.lam``; not whitened), and how well the values explain the returns::

        delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1}
    """
    p, g, n = token_r.shape
    flat = lambda x: x.reshape(p * g, n)  # noqa: E731
    adv, returns = gae(flat(token_r), flat(values), flat(mask), gamma=cfg.gamma, lam=cfg.lam)
    ev = explained_variance(flat(values), returns, flat(mask))
    return adv.reshape(p, g, n), returns.reshape(p, g, n), ev


def make_advantage(cfg: PPOConfig) -> Stage:
    """Token rewards, values, advantages and the loss mask over the batch's ``policy_tokens``
    (multi-turn trajectories: GAE steps over the observation tokens, which the values and the
    critic still read)."""

    def advantage(state: TrainState, batch: Scored) -> tuple[TrainState, PPOBatch]:
        p, g, n = batch.tokens.shape
        score_ok = jnp.isfinite(batch.rewards)
        score = jnp.where(score_ok, batch.rewards, 0.0)
        loss_mask = batch.policy_tokens * score_ok[..., None]
        m = loss_mask > 0
        r, kl = kl_token_rewards(cfg, score, loss_mask, batch.old_logprobs, batch.ref_logprobs)
        flat = lambda x: x.reshape(p * g, n)  # noqa: E731
        out = PPOBatch.of(batch, loss_mask=loss_mask, token_rewards=r, kl_to_ref=kl)
        out = rope_tables(cfg, state, out)
        if cfg.advantage == "gae":
            values = state_values(cfg, state, out)
            adv, returns, ev = gae_terms(cfg, r, values, m)
            adv = flat(adv)
            out = out.replace(old_values=values, returns=returns, explained_variance=ev)
        else:  # VinePPO: V(s_t) from branched rollouts; the terminal value is the score
            adv = step_advantages(out.mc_values, batch.lengths, score, every=cfg.vine_every, n=n)
            adv = flat(jnp.where(m, adv, 0.0)) - cfg.kl_coef * flat(kl)
        if cfg.whiten_advantages:
            adv = whiten(adv, flat(m))
        return state, out.replace(advantages=adv.reshape(p, g, n))

    return stage(advantage, name="advantage")


def rope_tables(cfg: PPOConfig, state: TrainState, batch: PPOBatch) -> PPOBatch:
    """The batch with the rotary tables of its completions, computed once for the values and both
    updates: ``rope`` (the policy's) and ``critic_rope`` (a separate critic's own: it may be
    another model than the policy), both in the layout the forwards run (the bins' slots when
    the batch was packed); an image prompt's tables are its ``PromptInputs``' (``batch.images``),
    which a separate critic reads too (``check_reads_prompt_inputs``: else a ``ValueError``)."""
    _, g, n = batch.tokens.shape

    def tables(config):
        if batch.packed is not None:
            return bins_rope(config, batch.packed)
        return completion_rope(config, batch.prompt_mask, g, n, batch.images)

    batch = batch.replace(rope=tables(state.policy.config))
    if cfg.needs_critic and not cfg.shared_critic:
        if batch.images is not None:  # the policy's features and RoPE tables: they must fit
            check_reads_prompt_inputs(state.critic.backbone.config, state.policy.config)
        batch = batch.replace(critic_rope=tables(state.critic.backbone.config))
    return batch


def state_values(cfg: PPOConfig, state: TrainState, batch: PPOBatch):
    """The critic's values ``[P, G, N]`` of the sampled states (no gradient; over the packed rows
    when the batch was packed; an image prompt's ``PromptInputs`` read as the policy reads
    them); the batch holds ``rope_tables``."""
    args = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask)
    how = cfg.forward.pass_(differentiated=False)
    common = dict(packed=batch.packed, prompt=batch.images)
    if cfg.shared_critic:
        values = completion_head_values(
            state.policy, state.critic, *args, how, rope=batch.rope, **common
        )
    else:
        values = completion_values(state.critic, *args, how, rope=batch.critic_rope, **common)
    return jax.lax.stop_gradient(values)


def make_update_stage(
    cfg: PPOConfig, passes: Passes, off_policy: OffPolicyConfig | None = None
) -> Stage:
    """The actor's and the critic's updates on the same minibatch split, then the reference rule."""
    rule = make_reference_rule(cfg.reference)
    split = dict(
        epochs=cfg.num_iterations,
        minibatches=cfg.num_minibatches,
        grad_accum=cfg.grad_accum,
        passes=passes,
    )

    def build(loss_fn, optimizer, batch: PPOBatch, config, critic_config=None, side=None):
        """The update of ``loss_fn``: padded, or over the batch's bins when it was packed;
        ``side``: a trained tower's features (padded image rows only)."""
        if batch.packed is None:
            return make_update(loss_fn, optimizer, side=side, **split)
        if side is not None:
            raise ValueError("a trained tower's image prompts run padded, never packed")
        binned = make_binned_update(
            loss_fn,
            optimizer,
            epochs=cfg.num_iterations,
            minibatches=cfg.num_minibatches,
            passes=passes,
            critic=critic_config is not None,
        )
        return lambda *args: binned(*args, config=config, critic_config=critic_config)

    def update(state: TrainState, batch: PPOBatch) -> tuple[TrainState, Updated]:
        key, k_actor, k_critic = jax.random.split(state.key, 3)
        critic, critic_opt_state = state.critic, state.critic_opt_state
        actor_rows = LossRows.of(batch, ref_logprobs=None)  # the KL is in the rewards
        vision = state.vision  # a trained tower (separate critics only: make_state)
        if (
            cfg.shared_critic
        ):  # one joint update of (policy, head), each part with its own optimizer
            joint = build(
                make_joint_loss(cfg, passes, off_policy),
                paired(state.optimizer, state.critic_optimizer),
                batch,
                state.policy.config,
            )
            rows = CriticRows.of(actor_rows, old_values=batch.old_values, returns=batch.returns)
            (policy, critic), (opt_state, critic_opt_state), metrics = joint(
                (state.policy, critic), (state.opt_state, critic_opt_state), rows, k_actor
            )
        else:
            tower = state.vision is not None  # a trained tower: its features in the gradient
            actor = build(
                make_actor_loss(cfg, passes, off_policy),
                state.optimizer,
                batch,
                state.policy.config,
                side=IMAGE_FEATURES if tower else None,
            )
            side_data = image_data(batch) if tower else None
            policy, vision, opt_state, metrics = update_policy(
                actor, state, actor_rows, k_actor, False, side_data
            )
        if cfg.needs_critic and not cfg.shared_critic:
            critic_update = build(
                make_critic_loss(cfg, passes),
                state.critic_optimizer,
                batch,
                state.policy.config,
                state.critic.backbone.config,
            )
            rows = CriticRows.of(
                actor_rows,
                old_values=batch.old_values,
                returns=batch.returns,
                critic_rope=batch.critic_rope,
                rope=None,
                old_logprobs=None,
                advantages=None,
                prox_logprobs=None,
            )
            critic, critic_opt_state, critic_metrics = critic_update(
                critic, critic_opt_state, rows, k_critic
            )
            metrics = {
                **metrics,
                **{
                    f"critic/{k}": v
                    for k, v in critic_metrics.items()
                    if k != "first_nonfinite_grad"
                },
            }
        step = state.step + 1
        ref = state.ref if state.ref is None else rule(state.ref, policy, step, {})
        bad = first_nonfinite(
            metrics["loss"],
            rewards=batch.rewards,
            advantages=batch.advantages,
            old_logprobs=batch.old_logprobs,
            ref_logprobs=batch.ref_logprobs,
            mask=batch.mask,
        )
        metrics, health = step_health(metrics, opt_state, bad)
        metrics = {**metrics, **_batch_metrics(cfg, batch)}
        new = state.replace(
            policy=policy,
            opt_state=opt_state,
            critic=critic,
            critic_opt_state=critic_opt_state,
            ref=ref,
            step=step,
            key=key,
            vision=vision,
        )
        return new, Updated(batch, metrics, health)

    return stage(update, name="update", reads_reference=True)


def _batch_metrics(cfg: PPOConfig, batch: PPOBatch) -> dict:
    m = batch.loss_mask > 0
    kl_sum = jnp.sum(jnp.where(m, batch.kl_to_ref, 0.0), -1)
    out = {
        "reward": jnp.nanmean(batch.rewards),
        "kl": masked_mean(batch.kl_to_ref, m),
        "non_score_reward": -cfg.kl_coef * jnp.mean(kl_sum),
        "completion_length": jnp.mean(batch.lengths.astype(jnp.float32)),
        "truncated_frac": jnp.mean(1.0 - batch.finished.astype(jnp.float32)),
        "advantage_mean": masked_mean(batch.advantages, m),
        **packing_metrics(batch.packed),
    }
    if cfg.needs_critic:
        out.update(
            returns_mean=masked_mean(batch.returns, m),
            values_mean=masked_mean(batch.old_values, m),
            explained_variance=batch.explained_variance,
        )
    for name, part in batch.reward_parts.items():
        out[f"reward/{name}"] = jnp.nanmean(part)
    return out


def ppo_parts(cfg: PPOConfig, *, host_after: tuple[Stage, ...] = ()) -> OnlineParts:
    """PPO's part of an online step (``relax.algorithms.online.step``); ``host_after``: VinePPO's
    Monte-Carlo values."""
    return OnlineParts(
        name="ppo_step",
        generation=cfg.generation,
        forward=cfg.forward,
        needs_reference=cfg.needs_reference,
        optimizer_steps=cfg.optimizer_steps,
        minibatches=cfg.num_minibatches,
        advantage=make_advantage(cfg),
        host_after=host_after,
        packing=cfg.packing,
        make_update=lambda passes, off_policy: make_update_stage(cfg, passes, off_policy),
    )


def make_ppo_step(cfg: PPOConfig, parts: StepParts) -> Stage:
    """``ppo_step(state, batch) -> (state, out)``; ``batch``, ``out`` and ``parts`` as GRPO's
    (``relax.algorithms.grpo.step.make_grpo_step``). The state holds the critic
    (``cfg.needs_critic``) and the reference (``cfg.needs_reference``). The reference log-probs
    are computed while ``parts.pool`` scores; run by the pipeline (``parts.pipelined``), the
    reference forward, the critic's values and GAE run with the update, on the models as they
    are then.

    Args:
        cfg: the PPO config (``PPOConfig``): sampling, the KL penalty ``kl_coef``, the advantage
            (``"gae"`` with a critic, or ``"vineppo"``), the critic and the update.
        parts: as ``make_grpo_step``'s (``StepParts``). VinePPO's Monte-Carlo values also use its
            reward functions, ``decode``, ``eos_ids``, ``pad_id``, ``on_error`` and ``timeout_s``.

    Returns:
        A ``Stage`` named ``"ppo_step"``, with ``make_grpo_step``'s input and output types. Its
            ``state`` is a ``TrainState`` with ``critic``, ``critic_opt_state`` and
            ``critic_optimizer`` when ``cfg.needs_critic``, and a reference when ``cfg.kl_coef > 0``
            (``relax.algorithms.ppo.run.make_state``). Its ``out.device`` is an ``Updated``: the
            ``PPOBatch`` it trained on, ``metrics`` (the policy loss's, a separate critic's as
            ``critic/<name>``, and reward, KL, length and advantage statistics) and ``health``.
    """
    mc_values = (
        (
            make_mc_values(
                cfg,
                cfg.generation.rollout(eos_ids=parts.eos_ids, pad_id=parts.pad_id),
                parts.reward_fns,
                parts.decode,
                on_error=parts.on_error,
                timeout_s=parts.timeout_s,
            ),
        )
        if cfg.advantage == "vineppo"
        else ()
    )
    return make_online_step(ppo_parts(cfg, host_after=mc_values), parts)
