"""The supervised (SFT) loss on one micro-batch of packed or padded rows, for ``relax.train.update``.

The batch is a ``relax.data.supervised.PackedBatch``: ``ids``, ``segment_ids`` (0 = padding, 1.. =
the example in its row) and ``loss_mask`` int32 ``[rows, T]``, ``loss_mask`` aligned with ``ids``: 1
where the token at ``t`` is a target, predicted from ``t - 1``. Log-probs come from the
packed forward (``relax.models.forward.packed``: examples never see each other and restart their
positions), so packing changes neither the loss nor its gradient. The loss is the token-sum
negative log-likelihood over the batch-wide normaliser::

    loss = -sum_{t in targets} log p(ids[t] | ids[<t] of its example) / ctx.norms["tokens"]
           (+ a mixture of experts' router loss, relax.models.moe.experts.router_loss, by token share)

so gradient accumulation and the split into micro-batches change nothing (``relax.train.update``).
A target must continue the example of the token before it (``segment_ids[t] == segment_ids[t-1]
> 0``); a ``loss_mask`` entry anywhere else is ignored. Metrics (plain means over the
micro-batch's targets, weighted by targets across micro-batches): ``nll`` (nats per target) and
``accuracy`` (the share of targets that are the argmax of the logits).
"""

from __future__ import annotations

import jax.numpy as jnp

from relax.data.supervised import PackedBatch
from relax.masked import masked_mean
from relax.models.decoder.logprobs import DEFAULT_CHUNK, logprobs_from_hidden
from relax.models.forward.packed import greedy_hits, packed_hidden_routed
from relax.models.moe.experts import MoEConfig, router_loss
from relax.train.update import LossContext, token_share


def target_mask(micro_batch: PackedBatch) -> jnp.ndarray:
    """``[rows, T-1]`` bool: position ``t`` predicts a target ``ids[t+1]`` of its own example."""
    seg, loss_mask = micro_batch.segment_ids, micro_batch.loss_mask
    return (loss_mask[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)


def make_sft_loss(
    *,
    remat: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    moe: MoEConfig = MoEConfig(),
    block: int | None = None,
):
    """``loss(policy, micro_batch, ctx) -> (scalar, metrics)``: the summed target NLL over
    ``ctx.norms["tokens"]`` (module docstring). ``remat`` recomputes each layer in the backward
    pass; ``chunk_size``: rows of logits at a time (``relax.models.decoder.logprobs``); ``moe``: the
    router losses of a mixture-of-experts model; ``block``: the packed attention's tile, None for
    the dense one (``relax.models.forward.packed``; the backend's: ``Passes.rows_block()``)."""

    def loss_fn(policy, mb: PackedBatch, ctx: LossContext):
        ids = mb.ids
        h, stats = packed_hidden_routed(policy, ids, mb.segment_ids, remat=remat, block=block)
        h = h[:, :-1]
        targets = ids[:, 1:]
        logp = logprobs_from_hidden(policy, h, targets, chunk_size=chunk_size)
        mask = target_mask(mb)
        nll = -jnp.where(mask, logp, 0.0)
        loss = jnp.sum(nll) / ctx.norms["tokens"]
        router, router_metrics = router_loss(stats, moe, policy.config)
        hits = greedy_hits(policy, h, targets, chunk_size=chunk_size)
        return loss + token_share(router, mask, ctx), {
            "nll": masked_mean(nll, mask),
            "accuracy": masked_mean(hits.astype(jnp.float32), mask),
            **router_metrics,
        }

    return loss_fn
