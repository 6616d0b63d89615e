"""Completions packed by token count, on the host: which completions share a row, and the
layout the training forwards read (``relax.models.forward.completion_packing.PackedCompletions``).

A group's completions go into rows by first-fit decreasing (``relax.data.supervised.pack_plan``,
as SFT examples are packed); ``PackingConfig`` chooses the rows and their length per batch, few
enough distinct layouts that each can be one compile.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from relax.data.supervised import pack_plan
from relax.models.forward.completion_packing import PackedCompletions

__all__ = ["PACKING_MODES", "PackingConfig", "pack_completions", "rows_needed"]

PACKING_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How the training forwards (update, reference, proximal) lay out a batch's completions.

    ``mode``: ``"on"`` packs every batch by token count
    (``relax.models.forward.completion_packing``), ``"off"`` keeps them
    padded to the budget, ``"auto"`` packs where the train attention is the group kernel (CPU,
    and any float32 model; not where the fused dense kernel runs it, GPU in 16 bits: cuDNN's
    attention has no segments, and it is 5x the group kernel there) and the packed rows have
    fewer slots than the padded ``[G, N]`` (a batch of long completions stays padded: packed rows
    as many as the padded ones cost ~15% more, their segment masks and gathers; see RESULTS.md).
    ``row_tokens``: tokens per packed row. None (the default) chooses per batch among the
    quarters of the budget N (``N/4, N/2, 3N/4, N``, each rounded up to a multiple of 8) that hold
    the batch's longest completion, the one with the fewest slots (rows x length): short batches
    get short rows, whose own attention (``C x C`` per row) costs less too. A number fixes it (at
    least N); a longer row packs more completions per row at a quadratic cost in its attention.
    ``row_multiple``: rows per group are rounded up to a multiple of it (None: a quarter of G,
    rounded up). A run meets at most ``4 x G / row_multiple`` layouts (one with a fixed
    ``row_tokens``), each one compile of the programs that read it.
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
            raise ValueError(
                "packing mode 'on' needs the 'group' train attention (the 'dense' one has no segments); "
                "set --grpo.train-attention group or --grpo.packing.mode auto"
            )
        return self.mode == "on" or (self.mode == "auto" and train_attention == "group")

    def saves(self, layout: tuple[int, int], shape: tuple[int, int, int]) -> bool:
        """Whether to pack a ``[P, G, N]`` batch in ``layout`` ``(rows, row_tokens)``: always with
        ``mode="on"``, else only when its rows have fewer slots than ``G x N``."""
        rows, width = layout
        return self.mode == "on" or rows * width < shape[1] * shape[2]

    def multiple(self, num_generations: int) -> int:
        return -(-num_generations // 4) if self.row_multiple is None else self.row_multiple

    def widths(self, budget: int) -> tuple[int, ...]:
        """The row lengths this config chooses from for a completion budget
        (``relax.models.forward.completion_packing``)."""
        if self.row_tokens is not None:
            if self.row_tokens < budget:
                raise ValueError(
                    f"packing row_tokens={self.row_tokens} is shorter than the completion budget {budget}"
                )
            return (self.row_tokens,)
        return tuple(sorted({min(budget, -(-budget * k // 4 // 8) * 8) for k in (1, 2, 3, 4)}))

    def choose(self, mask: np.ndarray, row_tokens: int | None = None) -> tuple[int, int]:
        """``(rows, row_tokens)`` of the packing of ``mask [P, G, N]``: at ``row_tokens`` when
        given (at least the longest completion), else the width with the fewest slots."""
        _, g, n = np.shape(mask)
        lengths = _lengths(mask)
        options = (
            (row_tokens,)
            if row_tokens is not None
            else [w for w in self.widths(n) if w >= lengths.max(initial=0)]
        )
        layouts = [(_rows(_plans(lengths, w), g, self.multiple(g)), w) for w in options]
        return min(layouts, key=lambda rw: (rw[0] * rw[1], -rw[1]))

    def describe(self, train_attention: str, num_generations: int, max_new_tokens: int) -> str:
        """One line for a start-up report: the layout the training forwards will use."""
        if not self.applies(train_attention):
            return (
                f"completions padded to {max_new_tokens} tokens in the update (packing {self.mode}, "
                f"{train_attention} train attention)"
            )
        widths = self.widths(max_new_tokens)
        multiple = self.multiple(num_generations)
        layouts = len(widths) * -(-num_generations // multiple)
        return (
            f"completions packed by token count in the update and reference: rows of "
            f"{' | '.join(map(str, widths))} tokens, rows per group a multiple of {multiple} "
            f"(at most {layouts} layouts, each compiled when first met)"
        )

    def pack(
        self, tokens: np.ndarray, mask: np.ndarray, layout: tuple[int, int] | None = None
    ) -> PackedCompletions:
        """``pack_completions`` of a ``[P, G, N]`` batch in ``layout`` ``(rows, row_tokens)``
        (default: ``choose(mask)``)."""
        rows, row_tokens = self.choose(mask) if layout is None else layout
        return pack_completions(tokens, mask, row_tokens=row_tokens, rows=rows)


def rows_needed(mask: np.ndarray, *, row_tokens: int, row_multiple: int = 1) -> int:
    """The rows per group ``R`` a packing of ``mask [P, G, N]`` into rows of ``row_tokens`` (at
    least its longest completion) takes (``relax.models.forward.completion_packing``)."""
    return _rows(_plans(_lengths(mask), row_tokens), mask.shape[1], row_multiple)


def _plans(lengths: np.ndarray, row_tokens: int) -> list[list[list[int]]]:
    """Per group, the completions of each row (``pack_plan``: first-fit decreasing)."""
    return [pack_plan([int(n) for n in row], row_tokens) for row in lengths]


def _rows(plans: list[list[list[int]]], g: int, row_multiple: int) -> int:
    """The fullest group's rows, rounded up to ``row_multiple`` (at most G: a completion fits a row)."""
    need = max(len(plan) for plan in plans)
    return min(-(-need // row_multiple) * row_multiple, g)


def pack_completions(
    tokens: np.ndarray,
    mask: np.ndarray,
    *,
    row_tokens: int,
    row_multiple: int = 1,
    rows: int | None = None,
) -> PackedCompletions:
    """Pack ``tokens``/``mask [P, G, N]`` into rows of ``row_tokens`` per group, as numpy arrays
    (``relax.models.forward.completion_packing``); ``rows``: this many rows per group instead of
    ``rows_needed``'s (at least that: e.g. the most any process of a multi-host run needs).
    Raises if a mask row is not a prefix or a completion is longer than ``row_tokens``."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    p, g, n = tokens.shape
    lengths = _lengths(mask)
    if lengths.max(initial=0) > row_tokens:
        raise ValueError(
            f"pack_completions: a completion of {lengths.max()} tokens does not fit rows of {row_tokens}"
        )
    plans = _plans(lengths, row_tokens)
    r = _rows(plans, g, row_multiple)
    if rows is not None:
        if rows < r:
            raise ValueError(
                f"pack_completions: rows={rows} cannot hold these completions (they need {r})"
            )
        r = rows
    out_tokens = np.zeros((p, r, row_tokens), np.int32)
    segments = np.zeros((p, r, row_tokens), np.int32)
    offsets = np.zeros((p, r, row_tokens), np.int32)
    source = np.zeros((p, g, n), np.int32)
    for i in range(p):
        for row, members in enumerate(plans[i]):
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
        raise ValueError(
            f"pack_completions: the mask of completion {g} of prompt {p} is not a prefix "
            "(1s up to the stop token, then 0s); only contiguous completions can be packed"
        )
    return lengths
