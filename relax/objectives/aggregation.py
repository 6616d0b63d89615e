"""Reduce a per-token loss ``[N, T]`` to a scalar, with explicit normalisers.

The normalisers are arguments so that minibatching and gradient accumulation cannot change what
the loss means. Pass the statistics of the WHOLE batch (all minibatches of one optimizer step)
and the aggregated minibatch losses *add up* to the full-batch loss, and so do their gradients:
accumulate by summing, not averaging. Left as None, a normaliser defaults to the value of the
array at hand, which is right only when that array is the whole batch.

Modes (verl's ``loss_agg_mode`` names), with ``L_it`` the loss, ``m_it`` the mask,
``n_i = sum_t m_it``::

    token-mean               sum_it m L / num_tokens                  num_tokens    = sum_it m
    seq-mean-token-mean      sum_i (sum_t m L / max(n_i, 1)) / num_sequences   num_sequences = N
    seq-mean-token-sum       sum_it m L / num_sequences
    seq-mean-token-sum-norm  sum_it m L / (num_sequences * max_len)   max_len = T

``seq-mean-token-sum-norm`` is Dr.GRPO's constant normaliser, as TRL's ``dr_grpo`` computes it
(``batch size * max_completion_length``); verl's mode of the same name divides by ``max_len``
alone (no mean over sequences), a factor N larger than this one.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from relax.masked import assert_same_shape, masked_count, masked_sum

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# TRL's GRPOConfig.loss_type -> mode. bnpo and dapo are both token-mean: TRL's bnpo normalises by
# the tokens of the local (micro)batch, dapo by the tokens of the whole accumulated batch; here
# that is the choice of ``num_tokens`` (default: this array's tokens, i.e. bnpo).
TRL_LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}


def resolve_mode(name: str) -> str:
    """A verl ``loss_agg_mode`` or a TRL ``loss_type`` name -> the verl mode name.

    Note TRL's ``grpo`` averages each minibatch over its own sequences; here the sequence count is
    ``num_sequences`` (the whole batch's when given), which makes minibatches add up.
    """
    if name in AGGREGATION_MODES:
        return name
    if name in TRL_LOSS_TYPES:
        return TRL_LOSS_TYPES[name]
    valid = ", ".join([*AGGREGATION_MODES, *TRL_LOSS_TYPES])
    raise ValueError(f"unknown aggregation mode {name!r}; valid: {valid}")


def aggregate(
    per_token_loss: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    mode: str,
    *,
    num_sequences: ArrayLike | None = None,
    num_tokens: ArrayLike | None = None,
    max_len: int | None = None,
) -> Float[Array, ""]:
    """Scalar loss under ``mode`` (a verl mode or TRL loss type; see the module docstring).

    ``num_tokens``: valid tokens of the whole batch (default: ``mask.sum()``, at least 1).
    ``num_sequences``: sequences of the whole batch (default: ``N``, rows of this array, counting
    fully masked rows as verl's ``torch.mean`` does). ``max_len``: Dr.GRPO's constant (default
    ``T``). Explicit normalisers are used as given (they may be traced arrays). Unused
    normalisers are ignored. Accumulates in at least float32; masked entries never contribute.
    """
    mode = resolve_mode(mode)
    assert_same_shape(per_token_loss=per_token_loss, mask=mask)
    chex.assert_rank(
        mask, 2, custom_message=f"per_token_loss and mask must be [N, T], got {jnp.shape(mask)}"
    )
    n, t = jnp.shape(mask)
    if mode == "token-mean":
        denom = jnp.maximum(masked_count(mask), 1.0) if num_tokens is None else num_tokens
        return masked_sum(per_token_loss, mask) / denom
    seqs = n if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(per_token_loss, mask, axis=-1) / jnp.maximum(
            masked_count(mask, axis=-1), 1.0
        )
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token_loss, mask) / seqs
    length = t if max_len is None else max_len
    return masked_sum(per_token_loss, mask) / (seqs * length)
