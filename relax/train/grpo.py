"""The GRPO step as five stages: ``grpo_step = compose(rollout, score, reference, advantage, update)``.

- ``rollout`` (jit): G completions per prompt with the prefix-shared sampler; the sampler's
  log-probs are the old-policy log-probs.
- ``score`` (host): decode completions, run the reward functions (TRL signature), combine.
- ``reference`` (jit): reference log-probs (when ``beta > 0``), computed once with the
  prefix-shared training forward and cached in the batch; it fuses with the two stages after
  it into one program (it runs after ``score`` so that it lives with the trainer).
- ``advantage`` (jit): group-relative advantages; all-equal groups get 0 (or are dropped).
- ``update`` (jit): epochs x minibatches of optimizer steps, then the reference rule.

The batch is a dict; its host entries (``prompts``, ``fields``) bypass the jitted stages.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relax import advantages as adv_lib
from relax.compose import Stage, compose, stage
from relax.losses.kl import kl_estimate
from relax.parallel import cache_sized_passes
from relax.reference import make_reference_rule, params_equal
from relax.rewards.functions import (RewardFunction, TokenRewardFunction, as_reward_functions, combine_checked,
                                    score_groups, score_tokens)
from relax.rewards.shaping import dynamic_sampling_mask, group_stats, length_shaping, overlong_penalty
from relax.rollout import RolloutConfig, _generate
from relax.sampling import SamplingConfig
from relax.stop_strings import truncate_at_stop_strings
from relax.train.config import GRPOConfig
from relax.train.forward import completion_logprobs
from relax.train.state import TrainState
from relax.train.health import first_nonfinite
from relax.train.update import consecutive_skipped_updates, make_update, skipped_updates


def rollout_config(cfg: GRPOConfig, *, eos_ids: tuple[int, ...], pad_id: int) -> RolloutConfig:
    return RolloutConfig(
        num_generations=cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p),
        eos_ids=eos_ids, pad_id=pad_id)


ROLLOUT_STREAM = 0x5EED  # the rollout's key: fold_in(state.key, ROLLOUT_STREAM); the update splits state.key


def make_rollout(cfg: GRPOConfig, *, eos_ids: tuple[int, ...], pad_id: int) -> Stage:
    rcfg = rollout_config(cfg, eos_ids=eos_ids, pad_id=pad_id)

    def rollout(state: TrainState, batch):
        # the state is read, not changed: the update advances the key once per iteration
        key = jax.random.fold_in(state.key, ROLLOUT_STREAM)
        r = _generate(state.policy, batch["prompt_ids"], batch["prompt_mask"], key, rcfg)
        out = {**batch, "tokens": r.tokens, "mask": r.mask, "old_logprobs": r.logprobs,
               "lengths": r.lengths, "finished": r.finished}
        return state, out

    # the rewards (a host stage) run next: if they raise, the caller's state is untouched
    return stage(rollout, name="rollout", updates_state=False)


def make_reference(cfg: GRPOConfig) -> Stage:
    """Reference log-probs of the sampled completions (when the state has a reference model),
    cached in the batch as ``ref_logprobs``; a stage of its own so that it can run where the
    reference lives (the trainer devices, see ``relax.parallel``).

    While the reference is bitwise the policy that sampled (``ref_is_policy``, also in the batch
    for the update), its log-probs are not recomputed: they ARE the policy's, the sampler's here
    (so a KL in the reward is exactly 0) and the trainer's own in the loss (``relax.train.update``),
    so the KL term and its gradient are exactly zero whatever the pass layout or mesh."""

    def reference(state: TrainState, batch):
        if state.ref is None:
            return state, batch
        same = params_equal(state.ref, state.policy, smallest_first=cache_sized_passes())

        def recompute():  # forward only: remat would recompute nothing
            return completion_logprobs(
                state.ref, batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["mask"],
                temperature=cfg.temperature, groups_per_pass=1 if cache_sized_passes() else None,
                attention=cfg.train_attention).astype(batch["old_logprobs"].dtype)

        ref_logprobs = jax.lax.stop_gradient(jax.lax.cond(same, lambda: batch["old_logprobs"], recompute))
        return state, {**batch, "ref_logprobs": ref_logprobs, "ref_is_policy": same}

    return stage(reference, name="reference")


def make_score(reward_fns: Sequence[RewardFunction | TokenRewardFunction | Callable],
               decode: Callable[[np.ndarray, np.ndarray], list[str]], *, on_error: str = "raise",
               timeout_s: float | None = None, stop_strings: tuple[str, ...] = ()) -> Stage:
    """Host stage: Python reward functions score the decoded completions (``score_groups``: each
    prompt's text and dataset fields repeated over its G completions, TRL's layout). Python reward
    functions get ``(prompts, completions, **fields)``; ``TokenRewardFunction``s run jitted on the
    token arrays. All are combined by weight (a sample is missing, NaN, only when every function
    is missing for it). First, completions are cut at their first stop string
    (``relax.stop_strings``: ``mask``, ``lengths`` and ``finished`` replaced)."""
    token_fns = tuple(f for f in reward_fns if isinstance(f, TokenRewardFunction))
    fns = as_reward_functions([f for f in reward_fns if not isinstance(f, TokenRewardFunction)])
    if not fns and not token_fns:
        raise ValueError("make_score needs at least one reward function")

    def score(state, batch):
        parts: dict[str, np.ndarray] = {}
        info: dict = {"errors": 0, "timeouts": 0}
        weights: dict[str, float] = {}
        out = dict(batch)
        if stop_strings:
            mask, lengths, finished = truncate_at_stop_strings(batch["tokens"], batch["mask"], batch["finished"],
                                                               decode, stop_strings)
            out.update(mask=jnp.asarray(mask), lengths=jnp.asarray(lengths), finished=jnp.asarray(finished))
            batch = out
        if fns:
            _, per, info, out["completions"] = score_groups(
                fns, decode, batch["prompts"], batch.get("fields", {}), batch["tokens"], batch["mask"],
                on_error=on_error, timeout_s=timeout_s)
            parts.update(per)
            weights.update({f.name: f.weight for f in fns})
        if token_fns:
            _, per = score_tokens(token_fns, batch["prompt_ids"], batch["prompt_mask"], batch["tokens"],
                                  batch["mask"])
            parts.update({k: np.asarray(v, np.float32) for k, v in per.items()})
            weights.update({f.name: f.weight for f in token_fns})
        total = combine_checked(parts, weights, completions=out.get("completions"))
        out.update(rewards=jnp.asarray(total, jnp.float32), reward_info=info,
                   reward_parts={k: jnp.asarray(v) for k, v in parts.items()})
        return state, out

    return stage(score, jit=False, name="score")


def shape_rewards(cfg: GRPOConfig, rewards: jax.Array, lengths: jax.Array) -> jax.Array:
    """DAPO overlong penalty and length shaping on ``[P, G]`` rewards, as configured."""
    if cfg.overlong_buffer is not None:
        rewards = rewards + overlong_penalty(lengths, max_length=cfg.max_new_tokens, buffer_length=cfg.overlong_buffer,
                                             penalty_factor=cfg.overlong_penalty_factor)
    if cfg.length_shaping is not None:
        rewards = length_shaping(rewards, lengths, mode=cfg.length_shaping, target=cfg.length_target,
                                 coef=cfg.length_coef)
    return rewards


def make_advantage(cfg: GRPOConfig) -> Stage:
    def advantage(state, batch):
        rewards = shape_rewards(cfg, batch["rewards"], batch["lengths"])
        if cfg.kl_in_reward:  # r - beta * sum_t KL_t, before the group baseline
            kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_estimator, mask=batch["mask"] > 0)
            rewards = rewards - cfg.beta * jnp.sum(kl, axis=-1)
        if cfg.advantage == "grpo":
            a = adv_lib.grpo(rewards, scale=cfg.scale_rewards, eps=cfg.advantage_eps)
        elif cfg.advantage == "rloo":
            a = adv_lib.rloo(rewards)
        else:  # token-level [P, G, N]
            a = adv_lib.reinforce_pp_baseline(rewards, batch["mask"] > 0)
        keep = dynamic_sampling_mask(rewards)  # False for all-equal (zero-signal) groups
        loss_mask = batch["mask"]
        if cfg.zero_std_groups == "drop":
            loss_mask = loss_mask * keep[:, None, None]
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * batch["finished"][..., None]
        return state, {**batch, "shaped_rewards": rewards, "advantages": a, "loss_mask": loss_mask,
                       "group_keep": keep}

    return stage(advantage, name="advantage")


def make_update_stage(cfg: GRPOConfig, optimizer) -> Stage:
    update_fn = make_update(cfg, optimizer)
    rule = make_reference_rule(cfg.reference)
    keys = ("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask", "old_logprobs", "advantages")

    def update(state: TrainState, batch):
        data = {k: batch[k] for k in keys}
        if cfg.beta > 0:
            data["ref_logprobs"] = batch["ref_logprobs"]
        key, sub = jax.random.split(state.key)
        policy, opt_state, metrics = update_fn(state.policy, state.opt_state, data, sub,
                                               batch.get("ref_is_policy", False))
        decay = 0.9  # running statistics for KL-target / entropy-floor reference resets
        running_kl = decay * state.running_kl + (1 - decay) * metrics.get("kl", jnp.float32(0.0))
        running_entropy = decay * state.running_entropy + (1 - decay) * metrics["entropy"]
        step = state.step + 1
        ref = state.ref
        if ref is not None:
            ref = rule(ref, policy, step, {"kl": running_kl, "entropy": running_entropy})
        health = {"first_nonfinite_grad": metrics.pop("first_nonfinite_grad"),
                  "first_nonfinite": first_nonfinite(batch, metrics["loss"]),
                  "consecutive_skips": consecutive_skipped_updates(opt_state)}
        metrics = {**metrics, **_batch_metrics(batch), "skipped_updates": skipped_updates(opt_state)}
        new = state.replace(policy=policy, opt_state=opt_state, ref=ref, step=step, key=key,
                            running_kl=running_kl, running_entropy=running_entropy)
        return new, {**batch, "metrics": metrics, "health": health}

    return stage(update, name="update")


def _batch_metrics(batch) -> dict:
    rewards = batch["rewards"]
    stats = group_stats(rewards)
    lengths = batch["lengths"].astype(jnp.float32)
    out = {**stats, "completion_length": jnp.mean(lengths),
           "truncated_frac": jnp.mean(1.0 - batch["finished"].astype(jnp.float32)),
           "advantage_mean": jnp.mean(batch["advantages"]), "advantage_std": jnp.std(batch["advantages"])}
    for name, part in batch["reward_parts"].items():
        out[f"reward/{name}"] = jnp.nanmean(part)
    return out


def make_grpo_step(cfg: GRPOConfig, optimizer, reward_fns, decode, *, eos_ids: tuple[int, ...], pad_id: int,
                   on_error: str = "raise", timeout_s: float | None = None) -> Stage:
    """``grpo_step(state, batch) -> (state, batch)`` with ``batch`` holding ``prompt_ids``,
    ``prompt_mask`` ``[P, Lp]`` and host entries ``prompts`` (list[str]) and ``fields``."""
    return compose(
        make_rollout(cfg, eos_ids=eos_ids, pad_id=pad_id),
        make_score(reward_fns, decode, on_error=on_error, timeout_s=timeout_s, stop_strings=cfg.stop_strings),
        make_reference(cfg),
        make_advantage(cfg),
        make_update_stage(cfg, optimizer),
        name="grpo_step",
    )
