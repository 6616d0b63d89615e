"""Completions packed across prompt groups into bins: the layout of a padding-free update.

A rollout returns each prompt's G completions padded to the budget, ``[P, G, N]``; with ragged
lengths most of that is padding, and a forward over it pays for every padded position. Packed,
the batch's prompts and completions lie one after the other in ``U`` bins of ``S`` slots (a
stream each): a prompt, then completions of its group, then the next prompt and its
completions, ... A group's completions may spread over several bins; each bin that holds one
of them holds a copy of its prompt first (prefix sharing within the bin: the prompt is computed
once per bin, not once per completion)::

    ids[u, s]        the token at slot s of bin u                       (0 in padding)
    positions[u, s]  its position: a prompt's tokens 0..len-1, its completion's token t at len + t
    docs[u, s]       0: padding; > 0 the document (one prompt copy, or one completion) it belongs to
    prefix_of[u, s]  the batch prompt p it belongs to, plus 1 (a prompt's token or its completion's)
    prefix[u, s]     the slot holds a prompt token
    source[u, s]     where the slot's token comes from: p Lp + i (token i of the left-padded
                     prompt p) or P Lp + (p G + g) N + t (token t of completion g of prompt p); -1
    predictor[u, s]  the slot whose hidden state predicts this slot's token: the slot before in
                     the same completion, its prompt's last slot for a completion's first token
    pairs[u], num_pairs[u]   the (query block, key block) pairs that hold a visible key
                     (``relax.models.attention.stream.block_pairs``): attention costs those only
    members[u, j], member_start[u, j]   the bin's completions (p G + g; -1: none) and the slot of
                     each one's first token: a micro-batch of bins reads its own rows ``[j, N]``
    bin_of[p, g], start[p, g]   where completion (p, g) lies (its token t at slot start + t of
                     bin bin_of; a completion with no token: bin 0, slot 0)

A completion token sees its own prompt's tokens and its own earlier tokens, nothing else
(``relax.models.attention.stream``), at the positions it has padded, so its log-probs are the
padded form's. Every bin is one static shape, whatever the lengths: a run compiles one layout,
and the bins a batch leaves empty (``num_pairs == 0``) are skipped at run time
(``relax.train.update``). The bins are built on the host from the completion mask
(``relax.data.completion_layout``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["CompletionBins", "to_padded", "to_rows"]


class CompletionBins(NamedTuple):
    """A batch's prompts and completions packed into ``U`` bins of ``S`` slots (module
    docstring). The per-bin leaves lead with ``[U]``; ``bin_of``/``start`` with ``[P, G]``."""

    ids: Int[Array, "u s"]
    positions: Int[Array, "u s"]
    docs: Int[Array, "u s"]
    prefix_of: Int[Array, "u s"]
    prefix: Bool[Array, "u s"]
    source: Int[Array, "u s"]
    predictor: Int[Array, "u s"]
    pairs: Int[Array, "u w 2"]
    num_pairs: Int[Array, " u"]
    members: Int[Array, "u c"]
    member_start: Int[Array, "u c"]
    bin_of: Int[Array, "p g"]
    start: Int[Array, "p g"]

    def per_bin(self) -> CompletionBins:
        """The bins' own leaves (``bin_of``/``start`` None): what a micro-batch of bins carries."""
        return self._replace(bin_of=None, start=None)


def to_padded(x: Float[Array, "u s"], bins: CompletionBins | None, n: int) -> Float[Array, "p g n"]:
    """Per-slot values of the bins back in the padded ``[P, G, N]`` layout::

        out[p, g, t] = x[bin_of[p, g], start[p, g] + t]

    (values past a completion's end are other slots', finite and meaningless: mask them).
    ``bins`` None: ``x`` is already ``[P, G, N]``."""
    if bins is None:
        return x
    u, s = x.shape
    flat = (bins.bin_of * s + bins.start)[..., None] + jnp.arange(n)
    return x.reshape(-1)[jnp.minimum(flat, u * s - 1)]


def to_rows(x: Float[Array, "b s"], bins: CompletionBins, n: int) -> Float[Array, "b c n"]:
    """Per-slot values of a micro-batch of bins as its members' rows ``[b, c, N]``::

        out[u, j, t] = x[u, member_start[u, j] + t]

    (meaningless past a member's end and for empty members: mask them)."""
    idx = jnp.minimum(bins.member_start[..., None] + jnp.arange(n), x.shape[-1] - 1)
    return jnp.take_along_axis(x, idx.reshape(x.shape[0], -1), axis=1).reshape(idx.shape)
