"""The Bradley-Terry loss on one micro-batch of preference pairs, for ``relax.train.update``.

A micro-batch is ``PairRows`` (``relax.algorithms.preference.pairs``) in ``relax.data.pairs``' layout:
``prompt_ids`` / ``prompt_mask`` ``[p, Lp]`` (left-padded), ``tokens`` / ``mask`` ``[p, 2, N]``
(index 0 the chosen completion, 1 the rejected one), ``loss_mask`` ``[p]`` (1 for a real pair; all
ones when the batch has none), an optional ``margin`` ``[p]`` and the rotary tables ``rope``. Both
completions of a pair are scored in one prefix-shared forward (``sequence_rewards`` with G = 2), and::

    loss = sum_pairs loss_mask * bradley_terry_loss(r_c, r_r; margin, centering) / ctx.norms["pairs"]

``ctx.norms["pairs"]`` is the number of real pairs of the whole batch over the minibatches
(``pair_normalizers``), so the micro-batch losses of an optimizer step sum to its minibatch's mean
loss whatever the micro-batching: gradient accumulation changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relax.algorithms.preference.pairs import PairRows
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.masked import masked_mean
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import attention_probs_bytes
from relax.models.heads.reward_model import sequence_rewards
from relax.objectives.preference import bradley_terry_loss
from relax.passes import Passes
from relax.train.update import LossContext


def pair_normalizers(batch) -> dict[str, jax.Array]:
    """``{"pairs": real pairs in the batch}`` (from its ``loss_mask`` ``[P]``), at least 1."""
    return {"pairs": jnp.maximum(jnp.sum(batch.loss_mask), 1).astype(jnp.float32)}


def pair_rewards(
    model, mb: PairRows, *, passes: Passes = Passes(), forward: ForwardConfig = ForwardConfig()
) -> jax.Array:
    """``[p, 2]`` rewards of a micro-batch's chosen and rejected completions (one forward, run as
    ``forward`` says)."""
    c = model.config
    how = forward.pass_().laid_out(passes, c, attention_probs_bytes(c, mb.prompt_ids, mb.tokens))
    return sequence_rewards(
        model, mb.prompt_ids, mb.prompt_mask, mb.tokens, mb.mask, how, rope=mb.rope
    )


def pair_metrics(chosen: jax.Array, rejected: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
    """Means over the real pairs: ``accuracy`` ([r_c > r_r]), ``margin`` (r_c - r_r), ``rewards/chosen``,
    ``rewards/rejected``."""
    sg = jax.lax.stop_gradient
    chosen, rejected = sg(chosen), sg(rejected)
    return {
        "accuracy": masked_mean((chosen > rejected).astype(jnp.float32), valid),
        "margin": masked_mean(chosen - rejected, valid),
        "rewards/chosen": masked_mean(chosen, valid),
        "rewards/rejected": masked_mean(rejected, valid),
    }


def make_loss(cfg: RewardModelConfig, passes: Passes = Passes()):
    """``loss(model, micro_batch, ctx) -> (scalar, metrics)``: the Bradley-Terry loss of the module
    docstring. Metrics are means over the micro-batch's real pairs (the update weighs micro-batches
    by their ``loss_mask``, i.e. by pairs, so the reduced metric is the batch mean)."""

    def loss_fn(model, mb: PairRows, ctx: LossContext):
        if mb.tokens.shape[1] != 2:
            raise ValueError(
                f"preference pairs need tokens [P, 2, N] (chosen, rejected), got {mb.tokens.shape}"
            )
        r = pair_rewards(model, mb, passes=passes, forward=cfg.forward)
        per_pair, _ = bradley_terry_loss(
            r[:, 0],
            r[:, 1],
            margin=mb.margin,
            center_rewards_coefficient=cfg.center_rewards_coefficient,
        )
        w = mb.loss_mask.astype(jnp.float32)
        loss = jnp.sum(jnp.where(w > 0, per_pair, 0.0) * w) / ctx.norms["pairs"]
        return loss, pair_metrics(r[:, 0], r[:, 1], w > 0)

    return loss_fn
