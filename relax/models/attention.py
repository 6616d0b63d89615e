"""Grouped-query attention over one or more key/value blocks, merged by log-sum-exp.

Queries are ``[B, T, Hq, D]`` and keys/values ``[B, S, Hkv, D]`` with ``Hq = R * Hkv``; the
``R`` query heads of a group share one KV head, so scores are computed as
``[B, Hkv, R, T, S]`` without repeating K and V.

A softmax over the union of several key blocks is assembled exactly from per-block partial
results (the cascade / Hydragen identity)::

    m_i = max_s z_is,   l_i = sum_s exp(z_is - m_i),   o_i = sum_s exp(z_is - m_i) v_s / l_i
    lse_i = m_i + log l_i
    o = sum_i exp(lse_i - lse) o_i,   lse = logsumexp_i lse_i

which is what the sampler uses to attend to one shared prompt block plus each completion's
own block, and what the prefix-shared training forward uses too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

NEG_INF = -1e30  # finite, so rows with no visible key give zeros, never NaN


def partial_attention(
    q: Float[Array, "b t hk r d"],
    k: Float[Array, "b s hk d"],
    v: Float[Array, "b s hk d"],
    allowed: Bool[Array, "b t s"] | Bool[Array, "b hk r t s"],
) -> tuple[Float[Array, "b t hk r d"], Float[Array, "b hk r t"]]:
    """Softmax attention of grouped queries over one key block.

    Returns the block-normalised output and the per-query log-sum-exp of the scores
    (float32; ``NEG_INF``-ish where nothing is visible). Scores are ``q.k / sqrt(d)``.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bthrd,bshd->bhrts", q, k, preferred_element_type=jnp.float32) * scale
    if allowed.ndim == 3:
        allowed = allowed[:, None, None]
    scores = jnp.where(allowed, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    p = jnp.where(allowed, p, 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    safe_l = jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("bhrts,bshd->bthrd", (p / safe_l).astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(safe_l[..., 0]), NEG_INF)
    return out, lse


def merge_partials(
    outs: list[Float[Array, "b t hk r d"]], lses: list[Float[Array, "b hk r t"]]
) -> Float[Array, "b t hk r d"]:
    """Exact softmax over the union of key blocks from per-block (output, lse) pairs."""
    stacked = jnp.stack(lses)  # [n, b, hk, r, t]
    total = jax.nn.logsumexp(stacked, axis=0)
    weights = jnp.exp(stacked - total)  # [n, b, hk, r, t]
    weights = jnp.moveaxis(weights, -1, 2)  # [n, b, t, hk, r]
    return sum(w[..., None] * o for w, o in zip(weights, outs))


def group_queries(q: Float[Array, "b t hq d"], num_kv_heads: int) -> Float[Array, "b t hk r d"]:
    b, t, hq, d = q.shape
    return q.reshape(b, t, num_kv_heads, hq // num_kv_heads, d)


def causal_mask(
    q_positions: Array, k_positions: Array, k_valid: Bool[Array, "b s"], window: int | None
) -> Bool[Array, "b t s"]:
    """``k_valid[s] & pos_k[s] <= pos_q[t]`` (and ``pos_q - pos_k < window`` when sliding)."""
    qp = q_positions[:, :, None]
    kp = k_positions[:, None, :]
    allowed = (kp <= qp) & k_valid[:, None, :]
    if window is not None:
        allowed = allowed & (qp - kp < window)
    return allowed


def attention(
    q: Float[Array, "b t hq d"],
    k: Float[Array, "b s hk d"],
    v: Float[Array, "b s hk d"],
    allowed: Bool[Array, "b t s"],
) -> Float[Array, "b t hq d"]:
    """Plain masked grouped-query attention over one block, output in ``q.dtype``."""
    b, t, hq, d = q.shape
    out, _ = partial_attention(group_queries(q, k.shape[2]), k, v, allowed)
    return out.reshape(b, t, hq, d).astype(q.dtype)
