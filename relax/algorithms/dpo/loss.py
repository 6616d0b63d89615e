"""The DPO-family loss on one micro-batch of preference pairs, for ``relax.train.update``.

Both completions of a pair go through ONE prefix-shared forward (``completion_logprobs`` with
``tokens [P, 2, N]``: the prompt once, its chosen and rejected completions as a group of 2, as the
rollout's G completions are). Per pair, from the token log-probs over the valid completion
tokens: the sequence log-probs ``s_c``, ``s_r`` (sums) and the length-normalised ``m_c``, ``m_r``
(means). With ``ref_*`` the reference's (sums; divided by the lengths for ipo)::

    sigmoid / hinge / robust:  dpo_loss(s_c, s_r, ref_c, ref_r)            (relax.objectives.preference)
    ipo:                       dpo_loss(m_c, m_r, ref_c / |c|, ref_r / |r|)
    simpo:                     -log s(beta (m_c - m_r) - gamma)             (label smoothing as DPO's)
    orpo:                      NLL(chosen) - lambda log s(log odds(m_c) - log odds(m_r))

    loss = sum_pairs loss_i / ctx.norms["pairs"]

ORPO's NLL is TRL's: one token mean over every chosen token of the batch (``-sum s_c /
ctx.norms["chosen_tokens"]``). The normalisers (``pair_normalizers``) count the whole batch, so
the micro-batch losses sum to the batch's and gradient accumulation changes nothing. Metrics
(TRL's names) are batch means over pairs, reduced exactly over micro-batches as sums of
``x_i / pairs``: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (the log-probs the loss compares:
sums, or means for ipo / simpo / orpo), plus ``nll``, ``log_odds_ratio`` and ``log_odds_chosen``
for ORPO.

While the policy is bitwise the reference (``ctx.ref_is_policy``), the reference log-probs are the
policy's own under a stop-gradient: the sigmoid loss is exactly ``log 2`` and the margins 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.images import pair_forward
from relax.algorithms.preference.pairs import Forward, PairRows, sequence_logps
from relax.metrics import Metric
from relax.objectives.preference import DPO_LOSS_TYPES, dpo_loss, orpo_loss, simpo_loss
from relax.passes import Passes
from relax.train.update import LossContext

sg = jax.lax.stop_gradient


def pair_normalizers(batch) -> dict[str, Array]:
    """The batch's real pairs (``loss_mask [P]``) and their chosen tokens, each at least 1
    (``batch``: ``PairRows`` or a ``relax.data.pairs.PairBatch`` with its ``loss_mask``)."""
    w = batch.loss_mask.astype(jnp.float32)
    chosen = jnp.sum(batch.mask[:, 0].astype(jnp.float32) * w[:, None])
    return {"pairs": jnp.maximum(jnp.sum(w), 1.0), "chosen_tokens": jnp.maximum(chosen, 1.0)}


def batch_mean(values: dict[str, Array], weights: Array, count: Array) -> dict[str, Metric]:
    """``sum_i w_i x_i / count`` of each per-example metric, reduced over micro-batches by ``sum``:
    with ``count`` the batch's, the exact batch mean however the rows are split."""
    return {
        k: Metric(jnp.sum(jnp.where(weights > 0, weights * v, 0.0)) / count, "sum")
        for k, v in values.items()
    }


def pair_losses(cfg: DPOConfig, sums, lengths, ref_sums, norms) -> tuple[Array, dict[str, Array]]:
    """Per-pair losses and metrics from ``[P, 2]`` policy sums / lengths and reference sums."""
    means = sums / lengths
    if cfg.loss_type in DPO_LOSS_TYPES:
        pol, ref = (means, ref_sums / lengths) if cfg.loss_type == "ipo" else (sums, ref_sums)
        losses, metrics = dpo_loss(
            pol[:, 0],
            pol[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            label_smoothing=cfg.label_smoothing,
        )
    elif cfg.loss_type == "simpo":
        pol = means
        losses, metrics = simpo_loss(
            pol[:, 0],
            pol[:, 1],
            beta=cfg.beta,
            gamma=cfg.simpo_gamma,
            label_smoothing=cfg.label_smoothing,
        )
    else:  # orpo: per-pair NLL shares whose mean over the batch's pairs is TRL's token-mean NLL
        pol = means
        nll = -sums[:, 0] * (norms["pairs"] / norms["chosen_tokens"])
        losses, metrics = orpo_loss(pol[:, 0], pol[:, 1], nll, beta=cfg.orpo_lambda)
        metrics = dict(metrics)
        metrics["nll"] = metrics.pop("nll_loss")
    return losses, {**metrics, "logps/chosen": sg(pol[:, 0]), "logps/rejected": sg(pol[:, 1])}


def make_dpo_loss(cfg: DPOConfig, passes: Passes = Passes(), forward: Forward | None = None):
    """``loss(policy, rows, ctx) -> (scalar, metrics)`` for a micro-batch of pairs, ``PairRows``
    (``relax.algorithms.preference.pairs``): ``tokens``/``mask`` ``[p, 2, N]`` (0 chosen, 1 rejected),
    ``loss_mask`` ``[p]``, optional ``rope``, and ``ref_logps`` ``[p, 2]`` when the loss uses a
    reference. ``forward``: how token log-probs are computed (default ``pair_forward``: the
    prefix-shared forward, with the prompts' ``PromptInputs`` for rows with images; a
    benchmark swaps it)."""
    forward = forward or pair_forward(passes, cfg.forward)

    def loss_fn(policy, mb: PairRows, ctx: LossContext):
        sums, lengths = sequence_logps(forward(policy, mb, True), mb.mask)
        ref = None
        if cfg.uses_reference:
            ref = jnp.where(ctx.ref_is_policy, sg(sums), mb.ref_logps.astype(jnp.float32))
        losses, metrics = pair_losses(cfg, sums, lengths, ref, ctx.norms)
        w = mb.loss_mask.astype(jnp.float32)
        loss = jnp.sum(jnp.where(w > 0, w * losses, 0.0)) / ctx.norms["pairs"]
        return loss, batch_mean(metrics, w, ctx.norms["pairs"])

    return loss_fn
