"""Compaction of the sampler's decode batch as its rows finish (``RolloutConfig.compactions``).

A decode step costs in proportion to its rows (their matmuls, their own KV caches), and a batch
of long-tailed lengths spends most of its steps on a few running rows beside many finished
ones. The sampler therefore runs in phases of static, shrinking row counts::

    B, ceil(B / 2), ceil(B / 4), ...     (each rounded up to a multiple of the mesh's batch shards)

Phase ``k`` decodes ``B_k`` rows while more than ``B_{k+1}`` of them still run; then the running
rows (and, to fill the ``B_{k+1}`` slots, some finished ones) are gathered, with their caches,
into the next phase's buffers (``keep_rows``: the running rows first, in their order). A phase
writes its tokens, log-probs and routes into buffers of its own rows (a step has no collective
beyond the stop check's); when it ends they are written back to their original rows of the
``[B, N]`` outputs, so the result is the uncompacted loop's up to float rounding (smaller
matmuls, joined cache blocks). Compacted rows mix prompts, so from phase 1 on
each row holds its own copy of its prompt's keys and values (``[B_k, Hkv, D, Lp]``) instead of
the prefix-shared ``[P, ...]`` (a prompt cache ``B_k / P`` times larger: at most ``G / 2``).

Each phase is a copy of the decode loops (one ``lax.while_loop`` per completion-cache block), so
the program, and its compile time, grows with the phases. The compacted phases therefore read
their caches in at most ``COMPACTED_BLOCKS`` larger blocks (phase 0's joined at the first
compaction): a step then reads up to a block of not-yet-filled slots, on half the rows or fewer.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

COMPACTED_BLOCKS = 4  # completion-cache blocks of a compacted phase: one decode loop each


def compaction_sizes(rows: int, compactions: int, multiple: int = 1) -> tuple[int, ...]:
    """Row counts of the decode phases: ``rows``, then up to ``compactions`` halvings, each rounded
    up to a multiple of ``multiple`` (the batch shards), as long as it shrinks."""
    sizes = [rows]
    for _ in range(compactions):
        half = -(-sizes[-1] // 2)
        nxt = -(-half // multiple) * multiple
        if nxt >= sizes[-1]:
            break
        sizes.append(nxt)
    return tuple(sizes)


def keep_rows(finished: Bool[Array, " b"], size: int) -> Int[Array, " size"]:
    """The ``size`` rows a compaction keeps: every running row, in order, then finished ones
    (as many as the slots left; the caller compacts only when the running rows fit)."""
    return jnp.argsort(finished, stable=True)[:size]
