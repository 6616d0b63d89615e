"""Held-out examples in batches of one shape, for an offline trainer's evaluation: one compiled
program whatever the number of examples (``eval_batches``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def eval_batches(
    examples: Sequence, batch_size: int, collate: Callable[[list], Any]
) -> list[tuple[Any, int]]:
    """``(batch, real rows)`` of ``examples`` in batches of ``batch_size``: the last is filled up
    with copies of its first example whose ``loss_mask`` is 0 (counted nowhere). ``collate``: a
    list of examples -> a batch (an ``equinox.Module``) with a ``loss_mask`` field ``[rows]``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        real = len(chunk)
        batch = collate(chunk + [chunk[0]] * (batch_size - real))
        out.append(
            (
                dataclasses.replace(
                    batch, loss_mask=(np.arange(batch_size) < real).astype(np.int32)
                ),
                real,
            )
        )
    return out
