"""Completions packed by token count: the layout of a padding-free update.

A rollout returns each prompt's G completions padded to the budget, ``[P, G, N]``; with ragged
lengths most of that is padding, and a forward over it pays for every padded position. Packed,
each group's completions lie one after the other in ``R`` rows of ``C >= N`` tokens
(first-fit decreasing: longest first, each into the first row with room), so a group costs
about its real tokens::

    tokens[p, r, c]    the token at slot c of row r          (0 in padding)
    segments[p, r, c]  k > 0: the row's k-th completion;  0: padding
    offsets[p, r, c]   the token's index t within its completion
    source[p, g, t]    r * C + c: where completion g's token t lies (0 where mask[p, g, t] = 0)

The prompt stays computed once per group (prefix sharing): every packed completion attends its
group's prompt keys and its own causal keys (``prefix_group_attention``'s segment test), at the
positions it has padded (prompt length + t), so its log-probs are the padded form's, and
``unpack`` gathers them back into ``[P, G, N]`` where the loss, its normalisers and metrics read
them unchanged.

``R`` is the same for every group of a batch (the most any group needs, rounded up to a
multiple of ``row_multiple`` and at most G): each distinct R is one more compile of the
programs that read the layout, so the multiple bounds them (G / row_multiple shapes at most).
Packing is computed on the host (numpy) from the completion mask, which must be a prefix of
each row (1 up to and including the stop token: every rollout's).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["PACKING_MODES", "PackedCompletions", "PackingConfig", "pack_completions", "rows_needed", "unpack"]

PACKING_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How the training forwards (update, reference, proximal) lay out a batch's completions.

    ``mode``: ``"on"`` packs them by token count (module docstring), ``"off"`` keeps them padded
    to the budget, ``"auto"`` packs where the train attention is the group kernel (CPU, and any
    float32 model) and keeps the padded layout where the fused dense kernel runs it (GPU in
    16 bits: cuDNN's attention has no segments, and it is 5x the group kernel there).
    ``row_tokens``: tokens per packed row, at least the completion budget (None: the budget); a
    longer row packs more completions per row at a quadratic cost in its own attention.
    ``row_multiple``: rows per group are rounded up to a multiple of it (None: a quarter of G,
    rounded up), so a run meets at most G / row_multiple layouts, each one compile.
    """

    mode: str = "auto"
    row_tokens: int | None = None
    row_multiple: int | None = None

    def __post_init__(self):
        if self.mode not in PACKING_MODES:
            raise ValueError(f"packing mode {self.mode!r}: valid {', '.join(PACKING_MODES)}")
        for name in ("row_tokens", "row_multiple"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"packing {name} must be >= 1, got {getattr(self, name)}")

    def applies(self, train_attention: str) -> bool:
        """Whether to pack, given the resolved train attention (``"group"`` or ``"dense"``)."""
        if self.mode == "on" and train_attention == "dense":
            raise ValueError("packing mode 'on' needs the 'group' train attention (the 'dense' one has no segments); "
                             "set --grpo.train-attention group or --grpo.packing.mode auto")
        return self.mode == "on" or (self.mode == "auto" and train_attention == "group")

    def layout(self, mask: np.ndarray) -> tuple[int, int]:
        """``(row_tokens, row_multiple)`` for a ``[P, G, N]`` batch (the defaults filled in)."""
        _, g, n = np.shape(mask)
        return (n if self.row_tokens is None else self.row_tokens,
                -(-g // 4) if self.row_multiple is None else self.row_multiple)

    def rows(self, mask: np.ndarray) -> int:
        """The rows per group this config packs ``mask [P, G, N]`` into."""
        row_tokens, multiple = self.layout(mask)
        return rows_needed(mask, row_tokens=row_tokens, row_multiple=multiple)

    def describe(self, train_attention: str, num_generations: int, max_new_tokens: int) -> str:
        """One line for a start-up report: the layout the training forwards will use."""
        if not self.applies(train_attention):
            return (f"completions padded to {max_new_tokens} tokens in the update (packing {self.mode}, "
                    f"{train_attention} train attention)")
        c = max_new_tokens if self.row_tokens is None else self.row_tokens
        multiple = -(-num_generations // 4) if self.row_multiple is None else self.row_multiple
        layouts = -(-num_generations // multiple)
        return (f"completions packed by token count in the update and reference: rows of {c} tokens, rows per group "
                f"a multiple of {multiple} (at most {layouts} layouts, each compiled when first met)")

    def pack(self, tokens: np.ndarray, mask: np.ndarray, rows: int | None = None) -> PackedCompletions:
        """``pack_completions`` of a ``[P, G, N]`` batch with this config's rows (or ``rows``)."""
        row_tokens, multiple = self.layout(mask)
        return pack_completions(tokens, mask, row_tokens=row_tokens, row_multiple=multiple, rows=rows)


class PackedCompletions(NamedTuple):
    """A batch's completions packed into ``R`` rows of ``C`` tokens per prompt group (module
    docstring). Every leaf leads with the prompt axis ``[P]``, so an update permutes and splits it
    with the rest of the batch."""

    tokens: Int[Array, "p r c"]
    segments: Int[Array, "p r c"]
    offsets: Int[Array, "p r c"]
    source: Int[Array, "p g n"]


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Completion indices per row: longest first, each into the first row with room (stable)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for g in sorted(range(len(lengths)), key=lambda i: -int(lengths[i])):
        need = int(lengths[g])
        for r, free in enumerate(room):
            if need <= free:
                rows[r].append(g)
                room[r] -= need
                break
        else:
            rows.append([g])
            room.append(capacity - need)
    return rows


def rows_needed(mask: np.ndarray, *, row_tokens: int, row_multiple: int = 1) -> int:
    """The rows per group ``R`` a packing of ``mask [P, G, N]`` takes (module docstring)."""
    lengths = _lengths(mask)
    g = mask.shape[1]
    need = max(len(_first_fit_decreasing(row, row_tokens)) for row in lengths)
    return min(-(-need // row_multiple) * row_multiple, g)  # need <= G: a completion fits a row


def pack_completions(tokens: np.ndarray, mask: np.ndarray, *, row_tokens: int, row_multiple: int = 1,
                     rows: int | None = None) -> PackedCompletions:
    """Pack ``tokens``/``mask [P, G, N]`` into rows of ``row_tokens`` (>= N) per group, as numpy
    arrays (module docstring); ``rows``: this many rows per group instead of ``rows_needed``'s
    (at least that: e.g. the most any process of a multi-host run needs). Raises if a mask row is
    not a prefix or ``row_tokens < N``."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    p, g, n = tokens.shape
    if row_tokens < n:
        raise ValueError(f"pack_completions: row_tokens={row_tokens} is shorter than the completion budget {n}")
    lengths = _lengths(mask)
    r = rows_needed(mask, row_tokens=row_tokens, row_multiple=row_multiple)
    if rows is not None:
        if rows < r:
            raise ValueError(f"pack_completions: rows={rows} cannot hold these completions (they need {r})")
        r = rows
    out_tokens = np.zeros((p, r, row_tokens), np.int32)
    segments = np.zeros((p, r, row_tokens), np.int32)
    offsets = np.zeros((p, r, row_tokens), np.int32)
    source = np.zeros((p, g, n), np.int32)
    for i in range(p):
        for row, members in enumerate(_first_fit_decreasing(lengths[i], row_tokens)):
            start = 0
            for k, j in enumerate(members, start=1):
                length = int(lengths[i, j])
                slots = slice(start, start + length)
                out_tokens[i, row, slots] = tokens[i, j, :length]
                segments[i, row, slots] = k
                offsets[i, row, slots] = np.arange(length)
                source[i, j, :length] = row * row_tokens + np.arange(start, start + length)
                start += length
    return PackedCompletions(out_tokens, segments, offsets, source)


def _lengths(mask: np.ndarray) -> np.ndarray:
    """Valid tokens per completion ``[P, G]``, checking that each mask row is a prefix."""
    m = np.asarray(mask) > 0
    lengths = m.sum(-1)
    prefix = np.arange(m.shape[-1]) < lengths[..., None]
    if not np.array_equal(m, prefix):
        p, g = np.argwhere((m != prefix).any(-1))[0]
        raise ValueError(f"pack_completions: the mask of completion {g} of prompt {p} is not a prefix "
                         "(1s up to the stop token, then 0s); only contiguous completions can be packed")
    return lengths


def unpack(x: Float[Array, "p r c"], source: Int[Array, "p g n"]) -> Float[Array, "p g n"]:
    """``x[p, g, t] = packed[p, source[p, g, t]]``: packed per-token values back in the padded
    layout (values at masked positions are the row's first slot's, finite and meaningless)."""
    p = x.shape[0]
    flat = x.reshape(p, -1)
    return jnp.take_along_axis(flat, source.reshape(p, -1), axis=1).reshape(source.shape)
