"""Stop strings: a completion ends at the token whose text completes a stop string.

The sampler stops on tokens (EOS ids); a stop string ("</answer>", "\\n\\nQuestion:") is text and
may fall across token boundaries, so it is found on the host after sampling: for each
completion, the first token ``t`` with ``stop in decode(tokens[:t + 1])`` is its last one. Its
mask is cut after ``t`` and it counts as finished::

    mask'[i] = mask[i] * (i <= t),   length' = t + 1,   finished' = True

Sampling is autoregressive, so the kept tokens and their log-probs are exactly those of a
sampler that had stopped at ``t`` (it only spent time on the tokens after it). The kept text
includes the stop string, as the policy sampled it. ``t`` is found by bisection over prefix
decodes: ``O(log N)`` decodes for a completion that holds a stop string, one for the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Decode = Callable[[np.ndarray, np.ndarray], list[str]]  # tokens [B, N], mask [B, N] -> B texts


def _first_stop_token(
    ids: np.ndarray, decode_ids: Callable[[np.ndarray], str], stops: Sequence[str]
) -> int | None:
    """Index of the first token whose prefix text holds a stop string; None when none does."""
    if not any(s in decode_ids(ids) for s in stops):
        return None
    lo, hi = 0, len(ids) - 1  # the prefix ending at hi holds a stop string; find the shortest
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode_ids(ids[: mid + 1]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def truncate_at_stop_strings(
    tokens: np.ndarray, mask: np.ndarray, finished: np.ndarray, decode: Decode, stops: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mask, lengths, finished)`` of completions ``tokens [..., N]`` cut at their first stop string.

    ``decode`` is the run's completion decoder (as for the reward functions); completions are
    right-aligned sequences whose valid tokens are ``mask > 0`` (a prefix). Without ``stops``
    the inputs come back unchanged (lengths from the mask)."""
    tokens, mask, finished = np.asarray(tokens), np.asarray(mask), np.asarray(finished, bool)
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    shape = tokens.shape
    flat_t, flat_m = tokens.reshape(-1, shape[-1]), mask.reshape(-1, shape[-1]).copy()
    flat_f = finished.reshape(-1).copy()
    if stops:
        decode_ids = lambda ids: decode(ids[None, :], np.ones((1, len(ids)), np.int32))[0]  # noqa: E731
        for i, (row, m) in enumerate(zip(flat_t, flat_m)):
            valid = row[m > 0]
            t = _first_stop_token(valid, decode_ids, stops) if len(valid) else None
            if t is not None:
                flat_m[i, t + 1 :] = 0
                flat_f[i] = True
    new_mask = flat_m.reshape(shape)
    return new_mask, new_mask.sum(axis=-1).astype(np.int32), flat_f.reshape(finished.shape)
