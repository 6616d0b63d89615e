"""The KTO loss on one micro-batch of unpaired examples, for ``relax.train.update``.

Per example, with ``rho = pi(y | x) - ref(y | x)`` (sequence log-probs of the example's own
completion, ``tokens[:, 0]``) and the batch's reference point ``z0`` (``kl``, computed before the
update by the step from the mismatched completions ``tokens[:, 1]``)::

    desirable:    w_d (1 - s(beta (rho - z0)))
    undesirable:  w_u (1 - s(beta (z0 - rho)))
    loss = sum_examples loss_i / ctx.norms["examples"]                  (TRL: the mean over the batch)

``z0`` is one value for the whole batch, so gradient accumulation changes nothing. Metrics (TRL's
names, exact batch means over micro-batches): ``rewards/chosen`` / ``rewards/rejected`` (``beta rho``
over the desirable / undesirable examples), ``rewards/margins`` (their difference), ``logps/chosen``
/ ``logps/rejected`` (the policy's sequence log-probs), ``kl`` (``z0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.preference.pairs import Forward, PairRows, sequence_logps, shared_forward
from relax.metrics import Metric
from relax.objectives.preference import kto_loss
from relax.passes import Passes
from relax.train.update import LossContext


def kto_normalizers(batch) -> dict[str, jax.Array]:
    """The batch's real examples (``loss_mask``) and its desirable / undesirable ones, each >= 1
    (``batch``: ``PairRows`` or a ``relax.data.pairs.UnpairedBatch`` with its ``loss_mask``)."""
    w = batch.loss_mask.astype(jnp.float32)
    d = (batch.label > 0).astype(jnp.float32)
    return {
        "examples": jnp.maximum(jnp.sum(w), 1.0),
        "desirable": jnp.maximum(jnp.sum(w * d), 1.0),
        "undesirable": jnp.maximum(jnp.sum(w * (1 - d)), 1.0),
    }


def make_kto_loss(cfg: KTOConfig, passes: Passes = Passes(), forward: Forward | None = None):
    """``loss(policy, rows, ctx) -> (scalar, metrics)``: ``rows`` (``PairRows``) hold the examples'
    own completions, ``tokens``/``mask`` ``[p, 1, N]``, with ``loss_mask``, ``label`` (1 =
    desirable), ``ref_logps`` ``[p, 1]`` and ``kl`` ``[p]``."""
    forward = forward or shared_forward(passes, cfg.forward)

    def loss_fn(policy, mb: PairRows, ctx: LossContext):
        sums, _ = sequence_logps(forward(policy, mb, True), mb.mask)
        logps = sums[:, 0]
        ref = jnp.where(
            ctx.ref_is_policy, jax.lax.stop_gradient(logps), mb.ref_logps[:, 0].astype(jnp.float32)
        )
        d = mb.label > 0
        losses, metrics = kto_loss(
            logps,
            ref,
            d,
            mb.kl,
            beta=cfg.beta,
            desirable_weight=cfg.desirable_weight,
            undesirable_weight=cfg.undesirable_weight,
        )
        w = mb.loss_mask.astype(jnp.float32)
        loss = jnp.sum(jnp.where(w > 0, w * losses, 0.0)) / ctx.norms["examples"]

        def mean_over(values, which, count):
            sel = (w > 0) & which
            return jnp.sum(jnp.where(sel, w * values, 0.0)) / count

        nd, nu = ctx.norms["desirable"], ctx.norms["undesirable"]
        r, lp = metrics["rewards"], jax.lax.stop_gradient(logps)
        chosen, rejected = mean_over(r, d, nd), mean_over(r, ~d, nu)
        out = {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": mean_over(lp, d, nd),
            "logps/rejected": mean_over(lp, ~d, nu),
        }
        out = {k: Metric(v, "sum") for k, v in out.items()}
        out["kl"] = Metric(jnp.max(mb.kl), "max")  # one value for the whole batch
        return loss, out

    return loss_fn
