"""The rows a preference loss reads (``PairRows``: the DPO family, KTO, reward models) and the
prefix-shared forward that scores a prompt's completions in one pass (``shared_forward``), with
their sequence log-probs (``sequence_logps``).

A preference batch (``relax.data.pairs``: ``PairBatch``, ``UnpairedBatch``) holds each prompt
once, left-padded, and its completions as a group ``[P, G, N]``, as the rollout's ``G``
completions are: ``relax.models.forward.prefix_shared`` runs the prompt once for the whole group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Real

from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import attention_probs_bytes
from relax.models.forward.prefix_shared import CompletionRope, completion_logprobs
from relax.passes import Passes
from relax.train.update import forward_groups

# forward(model, rows, train) -> token log-probs [P, G, N] of rows.tokens; rows: anything with
# prompt_ids, prompt_mask, tokens and mask (a PairRows, a PairBatch, an UnpairedBatch), and rope
# when train
Forward = Callable[[Any, Any, bool], Float[Array, "p g n"]]


class PairRows(eqx.Module):
    """What a preference loss reads, every leaf with the row axis first (``relax.train.update``
    slices them into micro-batches).

    ``prompt_ids`` / ``prompt_mask``: the prompts, left-padded. ``tokens`` / ``mask``: each row's
    completions, right-padded (DPO and reward models: ``g = 2``, chosen and rejected; KTO: ``g =
    1``, the row's own completion). ``loss_mask``: 1 for a real row, 0 for a padding row (a reward
    model's is float32). ``ref_logps``: the reference model's sequence log-probs of ``tokens``
    (None: a reference-free loss). ``margin``: the Bradley-Terry margin per pair (None: 0).
    ``label``: KTO's, 1 where the completion is desirable. ``kl``: KTO's reference point ``z0``,
    the batch's one value repeated per row. ``rope``: the rotary tables of the training forward,
    computed once outside the micro-batch loop (``completion_rope``; None: the forward computes
    them).
    """

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    loss_mask: Real[Array, " p"]
    ref_logps: Float[Array, "p g"] | None = None
    margin: Float[Array, " p"] | None = None
    label: Int[Array, " p"] | None = None
    kl: Float[Array, " p"] | None = None
    rope: CompletionRope | None = None


def shared_forward(passes: Passes = Passes(), config: ForwardConfig = ForwardConfig()) -> Forward:
    """The prefix-shared forward of ``relax.models.forward.prefix_shared`` run as ``config`` says and laid
    out as ``passes`` say: differentiated (``train``) with unrolled layers / saved attention where
    the passes ask for it and the rows' ``rope`` tables, or forward-only (a reference, no remat)
    one prompt group per pass."""

    def forward(model, rows, train: bool):
        args = (model, rows.prompt_ids, rows.prompt_mask, rows.tokens, rows.mask)
        if not train:
            return completion_logprobs(
                *args,
                config.pass_(differentiated=False, groups_per_pass=forward_groups(passes, rows)),
            )
        c = model.config
        probs_bytes = attention_probs_bytes(c, rows.prompt_ids, rows.tokens)
        return completion_logprobs(
            *args, config.pass_().laid_out(passes, c, probs_bytes), rope=rows.rope
        )

    return forward


def sequence_logps(
    logp: Float[Array, "p g n"], mask
) -> tuple[Float[Array, "p g"], Float[Array, "p g"]]:
    """``(sums, lengths)`` over the valid tokens of each completion (lengths at least 1)."""
    m = mask > 0
    return jnp.sum(jnp.where(m, logp, 0.0), axis=-1), jnp.maximum(jnp.sum(m, axis=-1), 1).astype(
        jnp.float32
    )
