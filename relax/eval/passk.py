"""Evaluation metrics over ``[P, n]`` samples (P prompts, n samples each): pass@k and summaries.

Host-side numpy (float64): evaluation runs after generation and scoring, on small arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Float


def _int_array(x: ArrayLike, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == bool or not np.all(np.equal(np.mod(a, 1), 0)):
        raise ValueError(f"{name} must hold integers, got {a!r}")
    return a.astype(np.int64)


def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float | np.ndarray:
    """Unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", eq. 1): the probability that a random k-subset of the n samples (c of them correct)
    holds at least one correct one::

        pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{j=0}^{k-1} (n-c-j) / (n-j)

    The product form (each factor in [0, 1], clipped at 0 once n-c-j < 0, i.e. when fewer than k
    samples are wrong) never forms large binomials. ``n`` and ``c`` broadcast against each other;
    a scalar result is a Python float. Needs ``1 <= k <= n`` and ``0 <= c <= n``.
    """
    n_a, c_a = np.broadcast_arrays(_int_array(n, "n"), _int_array(c, "c"))
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    k = int(k)
    if n_a.size and k > n_a.min():
        raise ValueError(f"pass@k needs k <= n; got k={k} and n={int(n_a.min())}")
    if n_a.size and ((c_a < 0) | (c_a > n_a)).any():
        raise ValueError(f"need 0 <= c <= n; got c={c_a.tolist()} for n={n_a.tolist()}")
    j = np.arange(k, dtype=np.float64)
    n_f, c_f = n_a[..., None].astype(np.float64), c_a[..., None].astype(np.float64)
    miss = np.prod(np.clip(n_f - c_f - j, 0.0, None) / (n_f - j), axis=-1)
    out = 1.0 - miss
    return float(out) if out.ndim == 0 else out


def default_ks(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to n, and n itself: ``default_ks(6) == (1, 2, 4, 6)``."""
    ks = [1 << i for i in range(max(n, 1).bit_length()) if 1 << i <= n]
    return tuple(sorted(set(ks) | {n}))


def _metrics(rewards: np.ndarray, correct: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    valid = ~np.isnan(rewards)
    n = correct.shape[1]
    out = {
        "num_prompts": float(rewards.shape[0]),
        "reward": float(rewards[valid].mean()) if valid.any() else float("nan"),
        "frac_reward_missing": float(1.0 - valid.mean()),
    }
    c = correct.sum(axis=1)
    for k in ks:
        out[f"pass@{k}"] = float(np.mean(pass_at_k(n, c, k)))
    return out


def summarize(
    rewards: Float[ArrayLike, "p n"],
    correct: Bool[ArrayLike, "p n"],
    *,
    ks: Sequence[int] | None = None,
    data_source: Sequence[str] | None = None,
) -> dict[str, float]:
    """Evaluation summary of n samples for each of P prompts::

        reward               mean of the valid (non-NaN) rewards (NaN if none)
        frac_reward_missing  fraction of NaN rewards
        pass@k               (1/P) sum_p pass_at_k(n, c_p, k),  c_p = sum_i correct[p, i]
                             (pass@1 = mean of ``correct``)
        num_prompts          P

    ``ks`` defaults to ``default_ks(n)`` (1, 2, 4, ..., n); pass@1 is always reported and every k
    must be <= n. With ``data_source`` (one label per prompt) the same metrics are also reported
    per group under ``"<source>/<metric>"`` (e.g. ``"math/pass@1"``), groups in order of first
    appearance. ``correct`` is separate from ``rewards`` (a shaped reward is not a verdict).
    """
    r = np.asarray(rewards, np.float64)
    ok = np.asarray(correct)
    if r.ndim != 2 or r.shape != ok.shape:
        raise ValueError(f"rewards and correct must both be [P, n], got {r.shape} and {ok.shape}")
    if ok.dtype != bool:
        raise ValueError(f"correct must be bool, got {ok.dtype}")
    p, n = r.shape
    if p == 0 or n == 0:
        raise ValueError(f"need at least one prompt and one sample, got [P, n] = {r.shape}")
    ks = default_ks(n) if ks is None else tuple(ks)
    for k in ks:
        if k > n:
            raise ValueError(f"pass@k needs k <= n; got k={k} and n={n}")
    ks = tuple(sorted({1, *(int(k) for k in ks)}))

    out = _metrics(r, ok, ks)
    if data_source is not None:
        src = [str(s) for s in data_source]
        if len(src) != p:
            raise ValueError(f"data_source has {len(src)} labels for {p} prompts")
        labels = np.asarray(src, dtype=object)
        for s in dict.fromkeys(src):
            rows = labels == s
            out.update({f"{s}/{key}": v for key, v in _metrics(r[rows], ok[rows], ks).items()})
    return out
