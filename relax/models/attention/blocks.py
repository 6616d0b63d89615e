"""Grouped-query attention over one or more key/value blocks, merged by log-sum-exp.

Keys and values are kept head-major, ``[B, Hkv, S, D]``, so that every score and output
product is a plain batched matmul over ``(B, Hkv)`` with no transpose of a cache (on CPU a
``[B, S, H, D]`` cache costs one full copy per layer per decode step). Queries are grouped
as ``[B, Hkv, M, D]``: the ``M`` rows of one KV head are its ``R = Hq / Hkv`` query heads
times the query positions (or, in the sampler, times the G completions that share a prompt).

A softmax over the union of several key blocks is assembled exactly from per-block partial
results (the cascade / Hydragen identity), kept unnormalised (``block_stats``)::

    m_i = max_s z_is,   l_i = sum_s exp(z_is - m_i),   u_i = sum_s exp(z_is - m_i) v_s
    o = sum_i exp(m_i - M) u_i / sum_i exp(m_i - M) l_i,   M = max_i m_i      (merge_stats)

which is what the sampler uses to attend to one shared prompt block plus each completion's
own blocks (no per-block division, log or log-sum-exp: fewer small ops per decode step).
``partial_attention`` gives one block's normalised output and log-sum-exp ``m + log l``.
Scores are ``q.k * scale``, ``scale = D^-1/2`` unless given (Gemma 3: ``query_pre_attn_scalar^-1/2``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

NEG_INF = -1e30  # finite, so rows with no visible key give zeros, never NaN


class BlockStats(NamedTuple):
    """One key block's unnormalised attention: ``u = sum_s exp(z_s - m) v_s``, ``m = max_s z_s``
    (about ``NEG_INF`` where nothing is visible), ``l = sum_s exp(z_s - m)`` (0 there), float32."""

    u: Float[Array, "b hk m d"]
    m: Float[Array, "b hk m"]
    l: Float[Array, "b hk m"]


def block_stats(
    q: Float[Array, "b hk m d"],
    k: Float[Array, "b hk s d"] | Float[Array, "b hk d s"],
    v: Float[Array, "b hk s d"],
    allowed: Bool[Array, "b #hk #m s"],  # noqa: F821 (a jaxtyping shape)
    *,
    k_transposed: bool = False,
    scale: float | None = None,
    probs_dtype=None,
) -> BlockStats:
    """Grouped queries over one key block, unnormalised (module docstring). ``k_transposed``: keys
    are stored ``[b, hk, d, s]``, which makes the score product a plain ``[m, d] x [d, s]`` matmul;
    the decode caches use it (with few query rows, XLA:CPU runs that ~3x faster). ``scale``: of
    the scores (None: ``D^-1/2``). ``probs_dtype``: of the probabilities in ``P V`` (None: ``v``'s;
    float32 over lower-precision ``v``: ``probs_times_values``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    spec = "bhmd,bhds->bhms" if k_transposed else "bhmd,bhsd->bhms"
    scores = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(scores - m), 0.0)
    u = probs_times_values(p, v, v.dtype if probs_dtype is None else probs_dtype)
    return BlockStats(u, m[..., 0], jnp.sum(p, axis=-1))


def probs_times_values(
    p: Float[Array, "b h m s"], v: Float[Array, "b h s d"], probs_dtype
) -> Float[Array, "b h m d"]:
    """``P V`` accumulated in float32, ``P`` rounded to ``probs_dtype``. Float32 ``P`` over
    lower-precision ``v`` is two products in ``v``'s dtype, ``P = P_hi + P_lo`` with ``P_hi =
    round(P)`` and ``P_lo = round(P - P_hi)`` (exact to about 2^-16 relative in bfloat16), stacked
    on the query rows so ``v`` is read once (no float32 copy of a cache)."""
    low = jnp.dtype(v.dtype)
    if jnp.dtype(probs_dtype) == low:
        return jnp.einsum("bhms,bhsd->bhmd", p.astype(low), v, preferred_element_type=jnp.float32)
    if low == jnp.float32:
        return jnp.einsum("bhms,bhsd->bhmd", p, v, preferred_element_type=jnp.float32)
    hi = p.astype(low)
    lo = (p - hi.astype(jnp.float32)).astype(low)
    m = p.shape[2]
    both = jnp.einsum(
        "bhms,bhsd->bhmd",
        jnp.concatenate([hi, lo], axis=2),
        v,
        preferred_element_type=jnp.float32,
    )
    return both[:, :, :m] + both[:, :, m:]


def merge_stats(blocks: list[BlockStats]) -> Float[Array, "b hk m d"]:
    """Exact softmax attention over the union of the blocks (float32; zeros where no key is visible)."""
    top = functools.reduce(jnp.maximum, [b.m for b in blocks])
    w = [jnp.exp(b.m - top) for b in blocks]
    num = sum(wi[..., None] * b.u for wi, b in zip(w, blocks))
    den = sum(wi * b.l for wi, b in zip(w, blocks))
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def partial_attention(
    q: Float[Array, "b hk m d"],
    k: Float[Array, "b hk s d"] | Float[Array, "b hk d s"],
    v: Float[Array, "b hk s d"],
    allowed: Bool[Array, "b #hk #m s"],  # noqa: F821 (a jaxtyping shape)
    *,
    k_transposed: bool = False,
    scale: float | None = None,
    probs_dtype=None,
) -> tuple[Float[Array, "b hk m d"], Float[Array, "b hk m"]]:
    """Softmax attention of grouped queries over one key block: the block-normalised output
    (float32) and the per-query log-sum-exp of the scores (float32; about ``NEG_INF`` where
    nothing is visible). ``k_transposed``, ``scale`` and ``probs_dtype`` as in ``block_stats``."""
    u, m, l = block_stats(
        q, k, v, allowed, k_transposed=k_transposed, scale=scale, probs_dtype=probs_dtype
    )
    safe_l = jnp.where(l > 0, l, 1.0)
    return u / safe_l[..., None], jnp.where(l > 0, m + jnp.log(safe_l), NEG_INF)


def heads_major(x: Float[Array, "b t h d"]) -> Float[Array, "b h t d"]:
    return jnp.swapaxes(x, 1, 2)


def causal_mask(
    q_positions: Array,
    k_positions: Array,
    k_valid: Bool[Array, "*b s"],
    window: int | Int[Array, ""] | None,
) -> Bool[Array, "*b t s"]:
    """``k_valid[s] & pos_k[s] <= pos_q[t]`` (and ``pos_q - pos_k < window`` when sliding; the
    window static, or a traced scalar)."""
    qp = q_positions[..., :, None]
    kp = k_positions[..., None, :]
    allowed = (kp <= qp) & k_valid[..., None, :]
    if window is not None:
        allowed = allowed & (qp - kp < window)
    return allowed


def block_mask(
    blocks: Int[Array, "*b t"],
    positions: Int[Array, "*b t"],
    valid: Bool[Array, "*b t"],
    window: int | Int[Array, ""] | None,
) -> Bool[Array, "*b t t"]:
    """``b(q) = b(k) > 0 & valid(k)`` (and ``k > q - W`` on sliding layers): the entries a
    bidirectional block adds to the causal mask of a sequence over itself."""
    bq, bk = blocks[..., :, None], blocks[..., None, :]
    allowed = (bq == bk) & (bq > 0) & valid[..., None, :]
    if window is not None:
        allowed = allowed & (positions[..., :, None] - positions[..., None, :] < window)
    return allowed


def attention(
    q: Float[Array, "b t hq d"],
    k: Float[Array, "b hk s d"],
    v: Float[Array, "b hk s d"],
    allowed: Bool[Array, "b t s"],
    *,
    scale: float | None = None,
    probs_dtype=None,
) -> Float[Array, "b t hq d"]:
    """Masked grouped-query attention of a sequence over one head-major block, in ``q.dtype``
    (``scale`` and ``probs_dtype`` as in ``block_stats``)."""
    b, t, hq, d = q.shape
    hk = k.shape[1]
    r = hq // hk
    qg = q.reshape(b, t, hk, r, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, r * t, d)
    mask = jnp.broadcast_to(allowed[:, None, None], (b, 1, r, t, allowed.shape[-1]))
    out, _ = partial_attention(
        qg, k, v, mask.reshape(b, 1, r * t, -1), scale=scale, probs_dtype=probs_dtype
    )
    return out.reshape(b, hk, r, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def shared_prefix_attention(
    q: Float[Array, "pg hk m d"],
    k: Float[Array, "p hk s d"] | Float[Array, "p hk d s"],
    v: Float[Array, "p hk s d"],
    allowed: Bool[Array, "p #hk #gm s"],  # noqa: F821 (a jaxtyping shape)
    num_gen: int,
    *,
    k_transposed: bool = False,
    scale: float | None = None,
    probs_dtype=None,
) -> BlockStats:
    """Attention of the G sequences of each group to their group's ONE prefix block.

    Queries ``[P*G, Hkv, M, D]`` are folded to ``[P, Hkv, G*M, D]`` so the prefix keys are read
    once per group (one dense product per KV head), then unfolded; returns the block's
    ``BlockStats`` for ``merge_stats``. ``allowed`` is over the folded rows ``(g, m)``;
    ``scale`` as in ``block_stats``.
    """
    b, hk, m, d = q.shape
    p = b // num_gen
    qp = q.reshape(p, num_gen, hk, m, d).transpose(0, 2, 1, 3, 4).reshape(p, hk, num_gen * m, d)
    stats = block_stats(
        qp, k, v, allowed, k_transposed=k_transposed, scale=scale, probs_dtype=probs_dtype
    )
    unfold = lambda x: (
        x.reshape((p, hk, num_gen, m) + x.shape[3:])
        .swapaxes(1, 2)
        .reshape((b, hk, m) + x.shape[3:])
    )
    return BlockStats(*map(unfold, stats))
