"""The reward-model step: one stage running the generic update (``relax.train.update``) of the
Bradley-Terry loss on ``state.policy`` (the ``TrainState``'s ``policy`` holds the ``RewardModel``).

    state = init_reward_model_state(cfg, base_model, key)
    step = make_reward_model_step(cfg)
    state, out = step(state, {"prompt_ids": ..., "prompt_mask": ..., "tokens": ..., "mask": ...})
    out["metrics"]   # loss, accuracy, margin, rewards/chosen, rewards/rejected, grad_norm, skipped_updates
    out["health"]    # first_nonfinite_grad, first_nonfinite, consecutive_skips (relax.train.health)

The batch is ``relax.data.pairs``' layout (``loss.py``: ``collate_pairs``' ``prompt_ids``,
``prompt_mask``, ``tokens``, ``mask`` and ``loss_mask``, which is all ones when absent), optionally
with a ``margin`` ``[P]`` column, which the loss then subtracts (TRL's ``margin``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from relax.compose import Stage, stage
from relax.models.prefix_shared import completion_rope
from relax.models.reward_model import RewardModel, init_reward_model
from relax.passes import Passes, choose_passes
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState, init_state
from relax.train.update import make_update

from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.loss import make_loss, pair_normalizers, pair_rewards

PAIR_KEYS = ("prompt_ids", "prompt_mask", "tokens", "mask")


def init_reward_model_state(cfg: RewardModelConfig, model, key: jax.Array) -> TrainState:
    """A ``TrainState`` whose ``policy`` is a reward model: ``model`` itself when it is a
    ``RewardModel`` (e.g. ``load_reward_model``), else one started from its backbone (head
    ``N(0, cfg.head_std)``); the optimizer is ``cfg.optimizer``'s. No reference model."""
    init_key, key = jax.random.split(key)
    if not isinstance(model, RewardModel):
        model = init_reward_model(model, init_key if cfg.head_std > 0 else None, head_std=cfg.head_std)
    return init_state(model, cfg.optimizer.make(), key=key)


def pair_data(batch, model_config) -> dict:
    """The update's data from a pair batch: its arrays, ``loss_mask`` ``[P]`` (1 for a real pair; the
    batch's, else all ones), the ``margin`` when the batch has one, and the rotary tables (once,
    outside the update's loops)."""
    tokens = batch["tokens"]
    if tokens.ndim != 3 or tokens.shape[1] != 2:
        raise ValueError(f"preference pairs need tokens [P, 2, N] (chosen, rejected), got {tokens.shape}")
    data = {k: batch[k] for k in PAIR_KEYS}
    data["loss_mask"] = (jnp.asarray(batch["loss_mask"], jnp.float32) if "loss_mask" in batch
                         else jnp.ones(tokens.shape[:1], jnp.float32))
    if "margin" in batch:
        data["margin"] = jnp.asarray(batch["margin"], jnp.float32)
    data["rope"] = completion_rope(model_config, batch["prompt_mask"], 2, tokens.shape[2])
    return data


def make_reward_model_step(cfg: RewardModelConfig, passes: Passes | None = None) -> Stage:
    """``step(state, batch) -> (state, batch + metrics + health)``: ``cfg.num_minibatches``
    optimizer steps of the Bradley-Terry loss on the batch's pairs, ``step + 1`` and a new key.
    ``passes``: the backend's pass layout (``relax.passes``; default ``choose_passes()``)."""
    passes = choose_passes() if passes is None else passes
    loss_fn = make_loss(cfg, passes)

    def update(state: TrainState, batch):
        update_fn = make_update(loss_fn, state.optimizer, minibatches=cfg.num_minibatches, grad_accum=cfg.grad_accum,
                                passes=passes, normalizers=pair_normalizers)
        key, sub = jax.random.split(state.key)
        model, opt_state, metrics = update_fn(state.policy, state.opt_state, pair_data(batch, state.policy.config), sub)
        metrics, health = step_health(metrics, opt_state, first_nonfinite({}, metrics["loss"]))
        new = state.replace(policy=model, opt_state=opt_state, step=state.step + 1, key=key)
        return new, {**batch, "metrics": metrics, "health": health}

    return stage(update, name="reward_model_update")


@jax.jit
def _pair_rewards(model, data):
    return pair_rewards(model, data)


def evaluate_pairs(model: RewardModel, batch, *, pairs_per_pass: int | None = None) -> dict[str, float]:
    """Held-out metrics of ``model`` on a pair batch (``relax.data.pairs``' layout): ``accuracy``,
    ``margin``, ``rewards/chosen``, ``rewards/rejected`` (means over the real pairs: ``loss_mask``
    when the batch has one). ``pairs_per_pass``: score that many pairs per forward (the last slice
    padded with copies of the first pair, which are not counted: one compile); None: all at once."""
    arrays = {k: np.asarray(v) for k, v in batch.items() if k in (*PAIR_KEYS, "margin", "loss_mask")}
    n = arrays["tokens"].shape[0]
    size = n if pairs_per_pass is None else min(pairs_per_pass, n)
    if size < 1:
        raise ValueError(f"need at least one pair and pairs_per_pass >= 1, got {n} pairs, "
                         f"pairs_per_pass={pairs_per_pass}")
    rewards = []
    for start in range(0, n, size):
        rows = np.arange(start, start + size)
        rows = np.where(rows < n, rows, 0)
        chunk = {k: jnp.asarray(v[rows]) for k, v in arrays.items()}
        rewards.append(np.asarray(_pair_rewards(model, pair_data(chunk, model.config))))
    r = np.concatenate(rewards)[:n].astype(np.float64)
    real = arrays["loss_mask"] > 0 if "loss_mask" in arrays else np.ones(n, bool)
    if not real.any():
        raise ValueError("no real pair to evaluate (loss_mask is all 0)")
    chosen, rejected = r[real, 0], r[real, 1]
    return {"accuracy": float(np.mean(chosen > rejected)), "margin": float(np.mean(chosen - rejected)),
            "rewards/chosen": float(np.mean(chosen)), "rewards/rejected": float(np.mean(rejected))}
