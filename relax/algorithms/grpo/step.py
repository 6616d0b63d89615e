"""The GRPO step as five stages: ``grpo_step = compose(rollout, score, reference, advantage, update)``.

- ``rollout`` (jit): G completions per prompt with the prefix-shared sampler; the sampler's
  log-probs are the old-policy log-probs.
- ``score`` (host, two halves): decode completions and hand the reward functions to the
  reward pool (``score_start``), then run the trainer-side ones, wait and combine (``score_finish``).
- ``pack`` (host, after ``score_start``): the completions packed by token count for the
  training forwards (``relax.models.completion_packing``; ``cfg.packing``).
- ``reference`` (jit, between the two halves): reference log-probs (when ``beta > 0``), computed
  once with the prefix-shared training forward and cached in the batch, on the device while the
  pool scores on the host.
- ``advantage`` (jit): group-relative advantages; all-equal groups get 0 (or are dropped).
- ``update`` (jit): epochs x minibatches of optimizer steps, then the reference rule.

Run by the pipeline (``pipelined=True``, ``relax.train.pipeline``) the step is
``compose(rollout, score, reference, [proximal], advantage, update)``: what runs on the sampler's
weights (rollout, rewards) comes first, and the reference forward runs with the update, on the
trainer's current reference; with an ``off_policy`` correction the loss clips against the
proximal policy (``relax.algorithms.grpo.loss``).

The batch is a dict; its host entries (``prompts``, ``fields``) bypass the jitted stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relax.compose import Stage, compose, stage
from relax.objectives import advantages as adv_lib
from relax.objectives.kl import kl_estimate
from relax.objectives.reference import make_reference_rule
from relax.passes import Passes, choose_passes
from relax.rewards.pool import RewardPool
from relax.rewards.shaping import dynamic_sampling_mask, group_stats, length_shaping, overlong_penalty
from relax.rollout.sampler import RolloutConfig
from relax.rollout.sampling import SamplingConfig
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState

from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.stages import make_packing, make_rollout, make_scoring, proximal_stages, reference_stages
from relax.objectives.off_policy import OffPolicyConfig, needs_proximal_pass


def rollout_config(cfg: GRPOConfig, *, eos_ids: tuple[int, ...], pad_id: int) -> RolloutConfig:
    return RolloutConfig(
        num_generations=cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p),
        eos_ids=eos_ids, pad_id=pad_id)


def shape_rewards(cfg: GRPOConfig, rewards: jax.Array, lengths: jax.Array) -> jax.Array:
    """DAPO overlong penalty and length shaping on ``[P, G]`` rewards, as configured."""
    if cfg.overlong_buffer is not None:
        rewards = rewards + overlong_penalty(lengths, max_length=cfg.max_new_tokens, buffer_length=cfg.overlong_buffer,
                                             penalty_factor=cfg.overlong_penalty_factor)
    if cfg.length_shaping is not None:
        rewards = length_shaping(rewards, lengths, mode=cfg.length_shaping, target=cfg.length_target,
                                 coef=cfg.length_coef)
    return rewards


def make_advantage(cfg: GRPOConfig, *, policy_tokens: str = "mask", per_turn: bool = False) -> Stage:
    """Advantages and the loss mask. ``policy_tokens``: the batch's mask of the tokens the policy
    sampled (``"sampled_mask"`` for multi-turn trajectories, whose ``mask`` also holds the
    observations); ``per_turn``: per-turn advantages from ``turn_rewards`` (``advantages.turn_grpo``)."""
    if per_turn and cfg.advantage != "grpo":
        raise ValueError(f"per-turn advantages are GRPO's; the config's advantage is {cfg.advantage!r}")

    def advantage(state, batch):
        policy_mask = batch[policy_tokens]
        rewards = shape_rewards(cfg, batch["rewards"], batch["lengths"])
        if cfg.kl_in_reward:  # r - beta * sum_t KL_t, before the group baseline
            kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_estimator, mask=policy_mask > 0)
            rewards = rewards - cfg.beta * jnp.sum(kl, axis=-1)
        if per_turn:
            a = adv_lib.turn_grpo(batch["turn_rewards"], batch["turn_index"], policy_mask > 0, eps=cfg.advantage_eps)
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
            loss_mask = loss_mask * batch["finished"][..., None]
        return state, {**batch, "shaped_rewards": rewards, "advantages": a, "loss_mask": loss_mask,
                       "group_keep": keep}

    return stage(advantage, name="advantage")


def make_update_stage(cfg: GRPOConfig, passes: Passes, off_policy: OffPolicyConfig | None = None) -> Stage:
    """Epochs x minibatches of the GRPO loss (``relax.train.update``), then the reference rule."""
    rule = make_reference_rule(cfg.reference)
    keys = ("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask", "old_logprobs", "advantages")
    keys += ("prox_logprobs",) if needs_proximal_pass(off_policy, cfg.optimizer_steps) else ()

    def update(state: TrainState, batch):
        update_fn = make_grpo_update(cfg, state.optimizer, passes, off_policy)
        data = {k: batch[k] for k in keys}
        if "packed" in batch:  # the completions packed by token count (make_packing)
            data["packed"] = batch["packed"]
        if cfg.beta > 0:
            data["ref_logprobs"] = batch["ref_logprobs"]
        key, sub = jax.random.split(state.key)
        policy, opt_state, metrics = update_fn(state.policy, state.opt_state, data, sub,
                                               batch.get("ref_is_policy", False))
        step, ref, ref_stats = state.step + 1, state.ref, state.ref_stats
        if ref_stats is not None:  # for KL-target / entropy-floor reference resets
            ref_stats = ref_stats.update(metrics.get("kl", jnp.float32(0.0)), metrics["entropy"])
        if ref is not None:
            ref = rule(ref, policy, step, {} if ref_stats is None else ref_stats.as_dict())
        metrics, health = step_health(metrics, opt_state, first_nonfinite(batch, metrics["loss"]))
        metrics = {**metrics, **_batch_metrics(batch)}
        new = state.replace(policy=policy, opt_state=opt_state, ref=ref, step=step, key=key, ref_stats=ref_stats)
        return new, {**batch, "metrics": metrics, "health": health}

    return stage(update, name="update", reads_reference=True)


def _batch_metrics(batch) -> dict:
    rewards = batch["rewards"]
    stats = group_stats(rewards)
    lengths = batch["lengths"].astype(jnp.float32)
    out = {**stats, "completion_length": jnp.mean(lengths),
           "truncated_frac": jnp.mean(1.0 - batch["finished"].astype(jnp.float32)),
           "advantage_mean": jnp.mean(batch["advantages"]), "advantage_std": jnp.std(batch["advantages"])}
    for name, part in batch["reward_parts"].items():
        out[f"reward/{name}"] = jnp.nanmean(part)
    if "packed" in batch:  # real completion tokens per slot of the packed rows, and rows per group
        out["pack_fill"] = jnp.mean((batch["packed"].segments > 0).astype(jnp.float32))
        out["pack_rows"] = jnp.float32(batch["packed"].segments.shape[1])
    return out


def make_grpo_step(cfg: GRPOConfig, reward_fns, decode, *, eos_ids: tuple[int, ...], pad_id: int,
                   passes: Passes | None = None, on_error: str = "raise", timeout_s: float | None = None,
                   pool: RewardPool | None = None, off_policy: OffPolicyConfig | None = None,
                   pipelined: bool = False) -> Stage:
    """``grpo_step(state, batch) -> (state, batch)`` with ``batch`` holding ``prompt_ids``,
    ``prompt_mask`` ``[P, Lp]`` and host entries ``prompts`` (list[str]) and ``fields``; the
    optimizer is the state's. ``passes``: the backend's pass layout (``relax.passes``; default
    ``choose_passes()``, one device; on a mesh pass ``choose_passes(batch_shards=...)``).
    ``pool``: the reward functions it hosts run in its workers while the device computes the
    reference log-probs (``make_score_stages``). ``off_policy``: the correction of stale batches;
    ``pipelined``: the order the pipeline runs (module docstring)."""
    passes = choose_passes() if passes is None else passes
    reference = reference_stages(cfg, passes)
    return compose(
        make_rollout(rollout_config(cfg, eos_ids=eos_ids, pad_id=pad_id)),
        *make_scoring(reward_fns, decode, reference=reference, pipelined=pipelined, on_error=on_error,
                      pack=(make_packing(cfg.packing, train_attention=cfg.train_attention),),
                      timeout_s=timeout_s, stop_strings=cfg.stop_strings, pool=pool),
        *proximal_stages(cfg, passes, off_policy),
        make_advantage(cfg),
        make_update_stage(cfg, passes, off_policy),
        name="grpo_step",
    )
