"""Supervised batches: tokenized examples (``relax.data.supervised``) -> padded or packed rows.

``pack(examples, row_length)`` places whole examples into rows of ``row_length``
tokens, by **first-fit-decreasing** (default: longest first, each into the first row with room;
fewest rows in practice, the examples' order is not kept) or ``method="greedy"`` (next fit in the
given order: a new row whenever the next example does not fit the current one). It returns a
``PackedBatch`` (``ids``, ``segment_ids``, ``loss_mask``, int32 ``[rows, row_length]``) for
``relax.models.forward.packed``. ``pad_rows`` is the unpacked alternative: one example per row,
right-padded, the same batch type. ``num_rows`` fixes the number of rows (empty rows are added;
too few rows is an error) so every batch has one shape. For a loader that batches rows,
``pack_rows`` packs a whole dataset once into rows of one shape (as TRL packs a dataset), each a
``PackedBatch`` of one row, and ``stack_rows`` stacks a batch of them. ``padding_fraction(batch)``:
the share of positions that hold no token.

``pad_examples`` (prompt + response rows with an attention mask) serves the built-in reverse task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import equinox as eqx
import numpy as np
from jaxtyping import Array, Int

from relax.choices import check_choice

if TYPE_CHECKING:
    from relax.data.supervised import SFTExample

PACK_METHODS = ("ffd", "greedy")


def pad_examples(
    prompts: list[list[int]], responses: list[list[int]], *, length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, loss_mask)`` ``[n, length]``: one ``[prompt | response]`` per row, right-padded;
    ``loss_mask`` is 1 on the response tokens (the prompt is never a target)."""
    n = len(prompts)
    ids = np.full((n, length), pad_id, np.int32)
    mask = np.zeros((n, length), np.int32)
    loss_mask = np.zeros((n, length), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > length:
            raise ValueError(
                f"example {i} has {len(p) + len(r)} tokens, more than the row length {length}"
            )
        ids[i, : len(p) + len(r)] = p + r
        mask[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) : len(p) + len(r)] = 1
    return ids, mask, loss_mask


class PackedBatch(eqx.Module):
    """Rows of supervised examples, packed (``pack``) or one per row (``pad_rows``): the batch
    of an SFT step (``relax.algorithms.sft``). Every field is int32 ``[rows, t]``.

    ``ids``: the tokens, ``pad_id`` where no example is. ``segment_ids``: 0 on padding, else the
    example's 1-based index in its row (``relax.models.forward.packed`` keeps attention and positions
    within an example). ``loss_mask``: 1 where ``ids[t]`` is a target, predicted from ``t - 1``
    (aligned with ``ids``, as ``SFTExample.loss_mask``).
    """

    ids: Int[Array, "rows t"]
    segment_ids: Int[Array, "rows t"]
    loss_mask: Int[Array, "rows t"]


def pack_plan(
    lengths: Sequence[int],
    row_length: int,
    *,
    method: str = "ffd",
    origins: Sequence[str] | None = None,
) -> list[list[int]]:
    """Which examples (indices into ``lengths``) go into each row, in row order (module docstring:
    ``"ffd"`` first-fit-decreasing, ``"greedy"`` next fit in order). An example longer than
    ``row_length`` is an error naming it (``origins[i]``, else its index)."""
    check_choice("pack method", method, PACK_METHODS)
    for i, n in enumerate(lengths):
        if n > row_length:
            name = origins[i] if origins is not None and origins[i] else f"example {i}"
            raise ValueError(f"{name}: {n} tokens do not fit a row of {row_length}")
    if method == "greedy":
        rows: list[list[int]] = []
        room = 0
        for i, n in enumerate(lengths):
            if not rows or room < n:
                rows.append([])
                room = row_length
            rows[-1].append(i)
            room -= n
        return rows
    return _first_fit_decreasing(lengths, row_length)


def _first_fit_decreasing(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Longest first (ties in their order), each into the first row with room: a max-tree over
    the rooms of ``len(lengths)`` rows (the unopened ones full) finds that row in O(log n)."""
    size = 1 << max(len(lengths) - 1, 0).bit_length()
    tree = [-1] * (2 * size)  # tree[node] = the largest room under node; leaves size..2*size-1
    tree[size : size + len(lengths)] = [row_length] * len(lengths)
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    rows: list[list[int]] = []
    for i in sorted(
        range(len(lengths)), key=lambda i: -lengths[i]
    ):  # stable: ties keep their order
        n, node = lengths[i], 1
        while node < size:  # the leftmost leaf with room >= n
            node = 2 * node if tree[2 * node] >= n else 2 * node + 1
        r = node - size
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def _rows(
    plan: list[list[int]],
    examples: Sequence[SFTExample],
    row_length: int,
    pad_id: int,
    num_rows: int | None,
) -> PackedBatch:
    n = len(plan) if num_rows is None else num_rows
    if len(plan) > n:
        raise ValueError(
            f"the examples need {len(plan)} rows of {row_length} tokens, more than num_rows={n}"
        )
    ids = np.full((n, row_length), pad_id, np.int32)
    seg = np.zeros((n, row_length), np.int32)
    loss = np.zeros((n, row_length), np.int32)
    for r, members in enumerate(plan):
        t = 0
        for s, i in enumerate(members, start=1):
            e = examples[i]
            ids[r, t : t + len(e)] = e.ids
            seg[r, t : t + len(e)] = s
            loss[r, t : t + len(e)] = e.loss_mask
            t += len(e)
    return PackedBatch(ids=ids, segment_ids=seg, loss_mask=loss)


def pack(
    examples: Sequence[SFTExample],
    row_length: int,
    *,
    pad_id: int = 0,
    method: str = "ffd",
    num_rows: int | None = None,
) -> PackedBatch:
    """Whole examples packed into rows of ``row_length`` tokens (module docstring); ``num_rows``
    pads with empty rows to that many."""
    plan = pack_plan(
        [len(e) for e in examples], row_length, method=method, origins=[e.origin for e in examples]
    )
    return _rows(plan, examples, row_length, pad_id, num_rows)


def pad_rows(
    examples: Sequence[SFTExample], row_length: int, *, pad_id: int = 0, num_rows: int | None = None
) -> PackedBatch:
    """One example per row, right-padded: a batch as ``pack``'s (``segment_ids`` 1 on tokens)."""
    for i, e in enumerate(examples):
        if len(e) > row_length:
            raise ValueError(
                f"{e.origin or f'example {i}'}: {len(e)} tokens do not fit a row of {row_length}"
            )
    return _rows([[i] for i in range(len(examples))], examples, row_length, pad_id, num_rows)


def pack_rows(
    examples: Sequence[SFTExample],
    row_length: int,
    *,
    pad_id: int = 0,
    method: str = "ffd",
    packing: bool = True,
) -> list[PackedBatch]:
    """A whole dataset as rows, for a loader that batches rows (``stack_rows``): each a
    ``PackedBatch`` of one row of ``row_length`` tokens; the examples packed (``pack``, by
    ``method``) or, without ``packing``, one per row (``pad_rows``)."""
    if not examples:
        return []
    b = (
        pack(examples, row_length, pad_id=pad_id, method=method)
        if packing
        else pad_rows(examples, row_length, pad_id=pad_id)
    )
    return [
        PackedBatch(
            ids=b.ids[i : i + 1],
            segment_ids=b.segment_ids[i : i + 1],
            loss_mask=b.loss_mask[i : i + 1],
        )
        for i in range(b.ids.shape[0])
    ]


def stack_rows(rows: Sequence[PackedBatch]) -> PackedBatch:
    """Rows of ``pack_rows`` (or any ``PackedBatch``es of one row length) as one batch."""
    return PackedBatch(
        ids=np.concatenate([r.ids for r in rows]),
        segment_ids=np.concatenate([r.segment_ids for r in rows]),
        loss_mask=np.concatenate([r.loss_mask for r in rows]),
    )


def padding_fraction(batch: PackedBatch) -> float:
    """The share of the batch's positions that hold no token (``segment_ids == 0``)."""
    seg = np.asarray(batch.segment_ids)
    return float(np.mean(seg == 0)) if seg.size else 0.0


def loss_tokens(batch: PackedBatch) -> int:
    """The batch's target tokens (``loss_mask`` sum)."""
    return int(np.sum(np.asarray(batch.loss_mask)))
