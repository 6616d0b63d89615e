"""Supervised rows: a prompt and its response, right-padded, the loss on the response only."""

from __future__ import annotations

import numpy as np


def pad_examples(prompts: list[list[int]], responses: list[list[int]], *, length: int, pad_id: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, loss_mask)`` ``[n, length]``: one ``[prompt | response]`` per row, right-padded;
    ``loss_mask`` is 1 on the response tokens (the prompt is never a target)."""
    n = len(prompts)
    ids = np.full((n, length), pad_id, np.int32)
    mask = np.zeros((n, length), np.int32)
    loss_mask = np.zeros((n, length), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > length:
            raise ValueError(f"example {i} has {len(p) + len(r)} tokens, more than the row length {length}")
        ids[i, :len(p) + len(r)] = p + r
        mask[i, :len(p) + len(r)] = 1
        loss_mask[i, len(p):len(p) + len(r)] = 1
    return ids, mask, loss_mask
