"""The GRPO step as five stages: ``grpo_step = compose(rollout, score, reference, advantage, update)``,
made by the online step factory (``relax.algorithms.online.step``) from GRPO's parts.

- ``rollout`` (jit): G completions per prompt with the prefix-shared sampler; the sampler's
  log-probs are the old-policy log-probs.
- ``score`` (host, two halves): decode completions and hand the reward functions to the
  reward pool (``score_start``), then run the trainer-side ones, wait and combine (``score_finish``).
- ``pack`` (host, after ``score_start``): the completions packed by token count for the
  training forwards (``relax.models.forward.completion_packing``; ``cfg.packing``).
- ``reference`` (jit, between the two halves): reference log-probs (when ``beta > 0``), computed
  once with the prefix-shared training forward and cached in the batch, on the device while the
  pool scores on the host.
- ``advantage`` (jit): group-relative advantages; all-equal groups get 0 (or are dropped).
- ``update`` (jit): epochs x minibatches of optimizer steps, then the reference rule.

Run by the pipeline (``StepParts.pipelined``, ``relax.train.pipeline``) the step is
``compose(rollout, score, reference, [proximal], advantage, update)``: what runs on the sampler's
weights (rollout, rewards) comes first, and the reference forward runs with the update, on the
trainer's current reference; with an ``off_policy`` correction (``StepParts.off_policy``) the loss clips against the
proximal policy (``relax.algorithms.grpo.loss``).

The batch is typed per phase (``relax.algorithms.online.batch``): the advantage makes a ``GRPOBatch``;
the host record (``prompts``, ``fields``, the decoded completions) rides beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.online.batch import Advantaged, LossRows, Scored
from relax.algorithms.online.stages import packing_metrics
from relax.algorithms.online.step import OnlineParts, StepParts, make_online_step
from relax.algorithms.online.vision import IMAGE_FEATURES, image_data
from relax.compose import Stage, stage
from relax.objectives import advantages as adv_lib
from relax.objectives.kl import kl_estimate
from relax.objectives.off_policy import OffPolicyConfig
from relax.objectives.reference import make_reference_rule
from relax.passes import Passes
from relax.rewards.shaping import (
    dynamic_sampling_mask,
    group_stats,
    length_shaping,
    overlong_penalty,
)
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState
from relax.train.update import Updated, update_policy


def shape_rewards(cfg: GRPOConfig, rewards: jax.Array, lengths: jax.Array) -> jax.Array:
    """DAPO overlong penalty and length shaping on ``[P, G]`` rewards, as configured."""
    if cfg.overlong_buffer is not None:
        rewards = rewards + overlong_penalty(
            lengths,
            max_length=cfg.generation.max_new_tokens,
            buffer_length=cfg.overlong_buffer,
            penalty_factor=cfg.overlong_penalty_factor,
        )
    if cfg.length_shaping is not None:
        rewards = length_shaping(
            rewards,
            lengths,
            mode=cfg.length_shaping,
            target=cfg.length_target,
            coef=cfg.length_coef,
        )
    return rewards


class GRPOBatch(Advantaged):
    """GRPO's advantaged batch: ``shaped_rewards`` (the rewards after the overlong penalty, length
    shaping and a KL in the reward: what the group baseline saw) and ``group_keep`` (False for a
    group whose rewards are all equal: no signal)."""

    shaped_rewards: Float[Array, "p g"] | None = None
    group_keep: Bool[Array, " p"] | None = None


def make_advantage(cfg: GRPOConfig, *, per_turn: bool = False) -> Stage:
    """Advantages and the loss mask over the batch's ``policy_tokens`` (the sampled ones;
    trajectories' observation tokens are read, not trained on); ``per_turn``: per-turn advantages
    from ``turn_rewards`` (``advantages.turn_grpo``)."""
    if per_turn and cfg.advantage != "grpo":
        raise ValueError(
            f"per-turn advantages are GRPO's; the config's advantage is {cfg.advantage!r}"
        )

    def advantage(state, batch: Scored) -> tuple[TrainState, GRPOBatch]:
        policy_mask = batch.policy_tokens
        rewards = shape_rewards(cfg, batch.rewards, batch.lengths)
        if cfg.kl_in_reward:  # r - beta * sum_t KL_t, before the group baseline
            kl = kl_estimate(
                batch.old_logprobs, batch.ref_logprobs, cfg.kl_estimator, mask=policy_mask > 0
            )
            rewards = rewards - cfg.beta * jnp.sum(kl, axis=-1)
        if per_turn:
            a = adv_lib.turn_grpo(
                batch.turn_rewards, batch.turn_index, policy_mask > 0, eps=cfg.advantage_eps
            )
        elif cfg.advantage == "grpo":
            a = adv_lib.grpo(rewards, scale=cfg.scale_rewards, eps=cfg.advantage_eps)
        elif cfg.advantage == "rloo":
            a = adv_lib.rloo(rewards)
        else:  # token-level [P, G, N]
            a = adv_lib.reinforce_pp_baseline(rewards, policy_mask > 0)
        keep = dynamic_sampling_mask(rewards)  # False for all-equal (zero-signal) groups
        loss_mask = policy_mask
        if cfg.zero_std_groups == "drop":
            loss_mask = loss_mask * keep[:, None, None]
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * batch.finished[..., None]
        return state, GRPOBatch.of(
            batch, shaped_rewards=rewards, advantages=a, loss_mask=loss_mask, group_keep=keep
        )

    return stage(advantage, name="advantage")


def loss_rows(batch: Advantaged, *, reference: bool) -> LossRows:
    """The rows a policy loss reads: the reference log-probs when the loss has a KL term."""
    return LossRows.of(batch, ref_logprobs=batch.ref_logprobs if reference else None)


def make_update_stage(
    cfg: GRPOConfig, passes: Passes, off_policy: OffPolicyConfig | None = None
) -> Stage:
    """Epochs x minibatches of the GRPO loss (``relax.train.update``), then the reference rule.
    The loss reads the proximal log-probs when the batch has them (the step's proximal stage)."""
    rule = make_reference_rule(cfg.reference)

    def update(state: TrainState, batch: Advantaged) -> tuple[TrainState, Updated]:
        tower = state.vision is not None  # a trained vision tower: its features in the gradient
        side = IMAGE_FEATURES if tower else None
        update_fn = make_grpo_update(cfg, state.optimizer, passes, off_policy, side)
        data = loss_rows(batch, reference=cfg.beta > 0)
        key, sub = jax.random.split(state.key)
        ref_is_policy = False if batch.ref_is_policy is None else batch.ref_is_policy
        side_data = image_data(batch) if tower else None
        policy, vision, opt_state, metrics = update_policy(
            update_fn, state, data, sub, ref_is_policy, side_data
        )
        step, ref, ref_stats = state.step + 1, state.ref, state.ref_stats
        if ref_stats is not None:  # for KL-target / entropy-floor reference resets
            ref_stats = ref_stats.update(metrics.get("kl", jnp.float32(0.0)), metrics["entropy"])
        if ref is not None:
            ref = rule(ref, policy, step, {} if ref_stats is None else ref_stats.as_dict())
        bad = first_nonfinite(
            metrics["loss"],
            rewards=batch.rewards,
            advantages=batch.advantages,
            old_logprobs=batch.old_logprobs,
            ref_logprobs=batch.ref_logprobs,
            mask=batch.mask,
        )
        metrics, health = step_health(metrics, opt_state, bad)
        metrics = {**metrics, **_batch_metrics(batch)}
        new = state.replace(
            policy=policy,
            opt_state=opt_state,
            ref=ref,
            step=step,
            key=key,
            ref_stats=ref_stats,
            vision=vision,
        )
        return new, Updated(batch, metrics, health)

    return stage(update, name="update", reads_reference=True)


def _batch_metrics(batch: Advantaged) -> dict:
    stats = group_stats(batch.rewards)
    lengths = batch.lengths.astype(jnp.float32)
    out = {
        **stats,
        "completion_length": jnp.mean(lengths),
        "truncated_frac": jnp.mean(1.0 - batch.finished.astype(jnp.float32)),
        "advantage_mean": jnp.mean(batch.advantages),
        "advantage_std": jnp.std(batch.advantages),
    }
    for name, part in batch.reward_parts.items():
        out[f"reward/{name}"] = jnp.nanmean(part)
    return {**out, **packing_metrics(batch.packed)}


def grpo_parts(cfg: GRPOConfig, *, per_turn: bool = False) -> OnlineParts:
    """GRPO's part of an online step (``relax.algorithms.online.step``)."""
    return OnlineParts(
        name="grpo_step",
        generation=cfg.generation,
        forward=cfg.forward,
        needs_reference=cfg.needs_reference,
        optimizer_steps=cfg.optimizer_steps,
        minibatches=cfg.num_minibatches,
        advantage=make_advantage(cfg, per_turn=per_turn),
        packing=cfg.packing,
        make_update=lambda passes, off_policy: make_update_stage(cfg, passes, off_policy),
    )


def make_grpo_step(cfg: GRPOConfig, parts: StepParts) -> Stage:
    """``grpo_step(state, batch) -> (state, out)``: ``batch`` a ``WithHost(Prompts, HostRecord)``
    (``relax.algorithms.online.batch.step_input``), ``out`` a ``WithHost(Updated, HostRecord)``; the
    optimizer is the state's. ``parts``: the reward functions and what they need, and the
    schedule (``relax.algorithms.online.step.StepParts``): the pool's reward functions run in its
    workers while the device computes the reference log-probs; ``parts.pipelined``: the order the
    pipeline runs (module docstring).

    Args:
        cfg: the GRPO-family config (``GRPOConfig``): sampling, reward shaping, advantage, loss
            and update. ``cfg.generation.temperature`` must be > 0.
        parts: the reward functions, ``decode`` (required) and the rest of ``StepParts``.

    Returns:
        A ``Stage`` named ``"grpo_step"``. Its ``state`` is a ``TrainState`` with a reference
            (``state.ref``, or a LoRA policy's base) when ``cfg.beta > 0``
            (``relax.algorithms.grpo.run.make_state``). Its ``out.device`` is an ``Updated``: the
            ``GRPOBatch`` it trained on, ``metrics`` (the loss's, ``grad_norm``,
            ``skipped_updates``, the rewards' group statistics, ``completion_length``,
            ``truncated_frac``, ``advantage_mean``, ``advantage_std``, ``reward/<name>`` per reward
            function) and ``health``.
    """
    return make_online_step(grpo_parts(cfg), parts)
