"""The reward-model step: one stage running the generic update (``relax.train.update``) of the
Bradley-Terry loss on ``state.policy`` (the ``TrainState``'s ``policy`` holds the ``RewardModel``).

    state = init_reward_model_state(cfg, base_model, key)
    step = make_reward_model_step(cfg)
    state, out = step(state, PairBatch(prompt_ids=..., prompt_mask=..., tokens=..., mask=...))
    out.metrics   # loss, accuracy, margin, rewards/chosen, rewards/rejected, grad_norm, skipped_updates
    out.health    # first_nonfinite_grad, first_nonfinite, consecutive_skips (relax.train.health)

The batch is a ``relax.data.pairs.PairBatch`` (``collate_pairs``: ``prompt_ids``, ``prompt_mask``,
``tokens``, ``mask`` and ``loss_mask``, which is all ones when None), optionally with a ``margin``
``[P]``, which the loss then subtracts (TRL's ``margin``); the output is a
``relax.train.update.Updated`` (the batch, ``metrics``, ``health``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.preference.pairs import PairRows
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.loss import make_loss, pair_normalizers, pair_rewards
from relax.compose import Stage, stage
from relax.data.pairs import PairBatch
from relax.models.forward.prefix_shared import completion_rope
from relax.models.heads.reward_model import RewardModel, init_reward_model
from relax.passes import Passes, choose_passes
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState, init_state
from relax.train.update import Updated, make_update


def init_reward_model_state(cfg: RewardModelConfig, model, key: jax.Array) -> TrainState:
    """A ``TrainState`` whose ``policy`` is a reward model: ``model`` itself when it is a
    ``RewardModel`` (e.g. ``load_reward_model``), else one started from its backbone (head
    ``N(0, cfg.head_std)``); the optimizer is ``cfg.optimizer``'s. No reference model.

    Args:
        cfg: the reward-model config: ``head_std`` (the new head's standard deviation; 0: a zero
            head) and ``optimizer`` are read here.
        model: a ``RewardModel``, used as it is, or a ``Transformer`` whose backbone is copied
            under a new head.
        key: the PRNG key: split into the head's initialisation key and the state's key.

    Returns:
        A fresh ``TrainState`` whose ``policy`` is the ``RewardModel``, with its optimizer state,
            ``step`` 0 and a key.
    """
    init_key, key = jax.random.split(key)
    if not isinstance(model, RewardModel):
        model = init_reward_model(
            model, init_key if cfg.head_std > 0 else None, head_std=cfg.head_std
        )
    return init_state(model, cfg.optimizer.make(), key=key)


def pair_data(batch: PairBatch, model_config) -> PairRows:
    """The update's rows from a pair batch: its pairs, ``loss_mask`` ``[P]`` float32 (1 for a real
    pair; the batch's, else all ones), the ``margin`` when the batch has one, and the rotary tables
    (once, outside the update's loops)."""
    tokens = batch.tokens
    if tokens.ndim != 3 or tokens.shape[1] != 2:
        raise ValueError(
            f"preference pairs need tokens [P, 2, N] (chosen, rejected), got {tokens.shape}"
        )
    loss_mask = (
        jnp.asarray(batch.loss_mask, jnp.float32)
        if batch.loss_mask is not None
        else jnp.ones(tokens.shape[:1], jnp.float32)
    )
    margin = None if batch.margin is None else jnp.asarray(batch.margin, jnp.float32)
    return PairRows(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        tokens=tokens,
        mask=batch.mask,
        loss_mask=loss_mask,
        margin=margin,
        rope=completion_rope(model_config, batch.prompt_mask, 2, tokens.shape[2]),
    )


def make_reward_model_step(cfg: RewardModelConfig, passes: Passes | None = None) -> Stage:
    """``step(state, batch) -> (state, Updated)``: ``cfg.num_minibatches`` optimizer steps of the
    Bradley-Terry loss on the batch's pairs, ``step + 1`` and a new key; ``Updated`` holds the
    batch, ``metrics`` and ``health``. ``passes``: the backend's pass layout (``relax.passes``;
    default ``choose_passes()``).

    Args:
        cfg: the reward-model config: the loss (``center_rewards_coefficient``),
            ``num_minibatches``, ``grad_accum`` and the forward options are read here.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.

    Returns:
        A ``Stage`` (one jitted stage, ``"reward_model_update"``): ``batch`` is a ``PairBatch`` with
            ``tokens`` ``[p 2 n]`` (chosen, rejected) and optionally ``loss_mask`` and ``margin``
            ``[p]``; ``state`` is ``init_reward_model_state``'s. The ``Updated`` holds the batch as
            given, ``metrics`` (module docstring) and ``health``.
    """
    passes = choose_passes() if passes is None else passes
    loss_fn = make_loss(cfg, passes)

    def update(state: TrainState, batch: PairBatch):
        update_fn = make_update(
            loss_fn,
            state.optimizer,
            minibatches=cfg.num_minibatches,
            grad_accum=cfg.grad_accum,
            passes=passes,
            normalizers=pair_normalizers,
        )
        key, sub = jax.random.split(state.key)
        model, opt_state, metrics = update_fn(
            state.policy, state.opt_state, pair_data(batch, state.policy.config), sub
        )
        metrics, health = step_health(metrics, opt_state, first_nonfinite(metrics["loss"]))
        new = state.replace(policy=model, opt_state=opt_state, step=state.step + 1, key=key)
        return new, Updated(batch=batch, metrics=metrics, health=health)

    return stage(update, name="reward_model_update")


@jax.jit
def _pair_rewards(model, rows):
    return pair_rewards(model, rows)


def evaluate_pairs(
    model: RewardModel, batch: PairBatch, *, pairs_per_pass: int | None = None
) -> dict[str, float]:
    """Held-out metrics of ``model`` on a pair batch (``relax.data.pairs.PairBatch``): ``accuracy``,
    ``margin``, ``rewards/chosen``, ``rewards/rejected`` (means over the real pairs: ``loss_mask``
    when the batch has one). ``pairs_per_pass``: score that many pairs per forward (the last slice
    padded with copies of the first pair, which are not counted: one compile); None: all at once."""
    arrays = PairBatch(
        prompt_ids=np.asarray(batch.prompt_ids),
        prompt_mask=np.asarray(batch.prompt_mask),
        tokens=np.asarray(batch.tokens),
        mask=np.asarray(batch.mask),
        loss_mask=None if batch.loss_mask is None else np.asarray(batch.loss_mask),
        margin=None if batch.margin is None else np.asarray(batch.margin),
    )
    n = arrays.tokens.shape[0]
    size = n if pairs_per_pass is None else min(pairs_per_pass, n)
    if size < 1:
        raise ValueError(
            f"need at least one pair and pairs_per_pass >= 1, got {n} pairs, "
            f"pairs_per_pass={pairs_per_pass}"
        )
    rewards = []
    for start in range(0, n, size):
        rows = np.arange(start, start + size)
        rows = np.where(rows < n, rows, 0)
        chunk = jax.tree.map(lambda v: jnp.asarray(v[rows]), arrays)
        rewards.append(np.asarray(_pair_rewards(model, pair_data(chunk, model.config))))
    r = np.concatenate(rewards)[:n].astype(np.float64)
    real = arrays.loss_mask > 0 if arrays.loss_mask is not None else np.ones(n, bool)
    if not real.any():
        raise ValueError("no real pair to evaluate (loss_mask is all 0)")
    chosen, rejected = r[real, 0], r[real, 1]
    return {
        "accuracy": float(np.mean(chosen > rejected)),
        "margin": float(np.mean(chosen - rejected)),
        "rewards/chosen": float(np.mean(chosen)),
        "rewards/rejected": float(np.mean(rejected)),
    }
