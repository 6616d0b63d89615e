"""The update of a batch packed into bins (``relax.models.forward.completion_packing``): the
bins are its rows, micro-batched as the passes say for rows of ``S`` positions
(``Passes.micro_batches``: one bin per micro-batch on a cache-sized CPU, elsewhere as many bins
per device as the token budget holds).

The loss rows stay whole, ``[P, G, N]`` (``LossRows``, PPO's ``CriticRows``); the generic update
(``relax.train.update``) permutes and splits the bins (``BinRows``: each bin's stream, its
slots' loss tokens and rotary tables), and each micro-batch's loss reads its bins' completions
as rows ``[b, c, N]`` (``member_rows``: member ``j`` of bin ``i`` is row ``(i, j)``, its tokens
at ``member_start[i, j] + t`` of the bin), so a loss written for ``[P, G, N]`` runs unchanged
on them. The normalisers are the whole batch's, as for a padded update; the bins a batch leaves
empty are dealt last and skipped (``make_update(skip_empty=True)``).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from relax.algorithms.online.batch import LossRows
from relax.models.config.model import ModelConfig
from relax.models.forward.completion_packing import CompletionBins
from relax.models.layers.rope import Rotary, rotary
from relax.passes import Passes
from relax.train.update import make_update, token_normalizers

__all__ = ["BinRows", "bin_rows", "bins_rope", "make_binned_update", "member_rows"]

_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
_MASK_FIELDS = ("mask", "loss_mask")


class BinRows(eqx.Module):
    """The rows of a packed update, each leaf leading with the bins ``[U]``: the bins' own
    streams, the loss tokens of their slots (``[U, S]``: what ``relax.train.update`` counts and
    skips by), their rotary tables (the policy's, and a separate critic's when it has one)."""

    bins: CompletionBins
    loss_mask: Int[Array, "u s"]
    rope: Rotary
    critic_rope: Rotary | None = None


def bins_rope(config: ModelConfig, bins: CompletionBins) -> Rotary:
    """The rotary tables of the bins' slots, computed once outside the update's loops."""
    return rotary(config, bins.positions)


def bin_rows(data: LossRows, config: ModelConfig, critic: ModelConfig | None = None) -> BinRows:
    """The update's rows of a packed batch ``data`` (``data.packed`` set): every bin's slot loss
    tokens from ``data.loss_mask`` through ``bins.source``; rotary tables of ``config`` (and of
    ``critic``), ``data.rope`` / ``data.critic_rope`` when they are the bins' already."""
    bins = data.packed
    p, g, n = data.tokens.shape
    offset = data.prompt_ids.size  # sources past the prompt tokens are completion tokens
    flat = data.loss_mask.reshape(-1)
    at = bins.source - offset
    loss_mask = jnp.where(at >= 0, flat[jnp.clip(at, 0, p * g * n - 1)], 0)
    rope = data.rope if isinstance(data.rope, Rotary) else bins_rope(config, bins)
    critic_rope = getattr(data, "critic_rope", None)
    if critic is not None and not isinstance(critic_rope, Rotary):
        critic_rope = bins_rope(critic, bins)
    return BinRows(bins.per_bin(), loss_mask, rope, critic_rope if critic is not None else None)


def member_rows(data: LossRows, mb: BinRows) -> LossRows:
    """The loss rows of a micro-batch of bins: every ``[P, G, ...]`` leaf of ``data`` gathered to
    ``[b, c, ...]`` by the bins' members (empty members' masks 0), ``packed`` the micro-batch's
    bins laid out so that the forwards' ``to_padded`` gives those rows, the bins' rotary tables;
    the prompt fields are unused by a packed forward (zeros ``[b, 1]``)."""
    members = mb.bins.members
    b, c = members.shape
    p, g = data.tokens.shape[:2]
    idx, valid = jnp.maximum(members, 0), members >= 0
    bins = mb.bins._replace(
        bin_of=jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, c)),
        start=mb.bins.member_start,
    )

    def rows(name, x):
        if name in _PROMPT_FIELDS:
            return jnp.zeros((b, 1), x.dtype)
        if not isinstance(x, jax.Array) or x.shape[:2] != (p, g):
            return x
        out = x.reshape((p * g,) + x.shape[2:])[idx]
        return out * valid[..., None].astype(out.dtype) if name in _MASK_FIELDS else out

    fields = {
        f.name: rows(f.name, getattr(data, f.name))
        for f in dataclasses.fields(data)
        if getattr(data, f.name) is not None
    }
    fields.update(packed=bins, rope=mb.rope)
    if "critic_rope" in fields or mb.critic_rope is not None:
        fields["critic_rope"] = mb.critic_rope
    return data.replace(**fields)


def make_binned_update(
    loss_fn,
    optimizer,
    *,
    epochs: int = 1,
    minibatches: int = 1,
    passes: Passes = Passes(),
    track_reference: bool = False,
    critic: bool = False,
):
    """``update(params, opt_state, data, key, ref_is_policy=False, *, config, critic_config=None)``:
    ``relax.train.update.make_update`` of ``loss_fn`` over the bins of a packed ``data``
    (``LossRows`` or a subclass), the bins micro-batched by ``passes`` (module docstring;
    ``grad_accum`` is for padded updates), the normalisers the whole batch's. ``critic``: the
    loss reads a separate critic's rotary tables (``critic_config``)."""

    def update(
        params, opt_state, data: LossRows, key, ref_is_policy=False, *, config, critic_config=None
    ):
        rows = bin_rows(data, config, critic_config if critic else None)
        inner = make_update(
            lambda p, mb, ctx: loss_fn(p, member_rows(data, mb), ctx),
            optimizer,
            epochs=epochs,
            minibatches=minibatches,
            grad_accum=None,  # Passes.micro_batches of rows of S positions (BinRows.loss_mask)
            passes=passes,
            normalizers=lambda _: token_normalizers(data),
            track_reference=track_reference,
            skip_empty=True,
        )
        return inner(params, opt_state, rows, key, ref_is_policy)

    return update
