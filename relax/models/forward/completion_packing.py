"""Completions packed by token count: the layout of a padding-free update.

A rollout returns each prompt's G completions padded to the budget, ``[P, G, N]``; with ragged
lengths most of that is padding, and a forward over it pays for every padded position. Packed,
each group's completions lie one after the other in ``R`` rows of ``C`` tokens, ``C`` at least
the batch's longest completion (first-fit decreasing: longest first, each into the first row
with room), so a group costs about its real tokens::

    tokens[p, r, c]    the token at slot c of row r          (0 in padding)
    segments[p, r, c]  k > 0: the row's k-th completion;  0: padding
    offsets[p, r, c]   the token's index t within its completion
    source[p, g, t]    r * C + c: where completion g's token t lies (0 where mask[p, g, t] = 0)

The prompt stays computed once per group (prefix sharing): every packed completion attends its
group's prompt keys and its own causal keys (``prefix_group_attention``'s segment test), at the
positions it has padded (prompt length + t), so its log-probs are the padded form's, and
``unpack`` gathers them back into ``[P, G, N]`` where the loss, its normalisers and metrics read
them unchanged.

``R`` and ``C`` are the same for every group of a batch (``R`` the most any group needs,
rounded up to a multiple of ``row_multiple`` and at most G; ``C`` one of a few widths,
``PackingConfig``): each distinct layout is one more compile of the programs that read it, so
the choices are few.
Packing is computed on the host from the completion mask (``relax.data.completion_layout``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["PackedCompletions", "to_padded", "unpack"]


class PackedCompletions(NamedTuple):
    """A batch's completions packed into ``R`` rows of ``C`` tokens per prompt group (module
    docstring). Every leaf leads with the prompt axis ``[P]``, so an update permutes and splits it
    with the rest of the batch."""

    tokens: Int[Array, "p r c"]
    segments: Int[Array, "p r c"]
    offsets: Int[Array, "p r c"]
    source: Int[Array, "p g n"]


def unpack(x: Float[Array, "p r c"], source: Int[Array, "p g n"]) -> Float[Array, "p g n"]:
    """``x[p, g, t] = packed[p, source[p, g, t]]``: packed per-token values back in the padded
    layout (values at masked positions are the row's first slot's, finite and meaningless)."""
    p = x.shape[0]
    flat = x.reshape(p, -1)
    return jnp.take_along_axis(flat, source.reshape(p, -1), axis=1).reshape(source.shape)


def to_padded(x: Float[Array, "p r c"], packed: PackedCompletions | None) -> Float[Array, "p g n"]:
    """Per-slot values of a forward's rows in the padded ``[P, G, N]`` layout: ``unpack`` them
    when the rows were ``packed``, else they already are."""
    return x if packed is None else unpack(x, packed.source)
