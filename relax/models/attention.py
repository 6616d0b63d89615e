"""Grouped-query attention over one or more key/value blocks, merged by log-sum-exp.

Keys and values are kept head-major, ``[B, Hkv, S, D]``, so that every score and output
product is a plain batched matmul over ``(B, Hkv)`` with no transpose of a cache (on CPU a
``[B, S, H, D]`` cache costs one full copy per layer per decode step). Queries are grouped
as ``[B, Hkv, M, D]``: the ``M`` rows of one KV head are its ``R = Hq / Hkv`` query heads
times the query positions (or, in the sampler, times the G completions that share a prompt).

A softmax over the union of several key blocks is assembled exactly from per-block partial
results (the cascade / Hydragen identity)::

    m_i = max_s z_is,   l_i = sum_s exp(z_is - m_i),   o_i = sum_s exp(z_is - m_i) v_s / l_i
    lse_i = m_i + log l_i
    o = sum_i exp(lse_i - lse) o_i,   lse = logsumexp_i lse_i

which is what the sampler uses to attend to one shared prompt block plus each completion's
own block. Scores are ``q.k / sqrt(D)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

NEG_INF = -1e30  # finite, so rows with no visible key give zeros, never NaN


def partial_attention(
    q: Float[Array, "b hk m d"],
    k: Float[Array, "b hk s d"] | Float[Array, "b hk d s"],
    v: Float[Array, "b hk s d"],
    allowed: Bool[Array, "b #hk #m s"],
    *,
    k_transposed: bool = False,
) -> tuple[Float[Array, "b hk m d"], Float[Array, "b hk m"]]:
    """Softmax attention of grouped queries over one key block.

    Returns the block-normalised output (float32) and the per-query log-sum-exp of the
    scores (float32; about ``NEG_INF`` where nothing is visible). ``k_transposed``: keys are
    stored ``[b, hk, d, s]``, which makes the score product a plain ``[m, d] x [d, s]`` matmul;
    the decode caches use it (with few query rows, XLA:CPU runs that ~3x faster).
    """
    scale = q.shape[-1] ** -0.5
    spec = "bhmd,bhds->bhms" if k_transposed else "bhmd,bhsd->bhms"
    scores = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    safe_l = jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("bhms,bhsd->bhmd", (p / safe_l).astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(safe_l[..., 0]), NEG_INF)
    return out, lse


def merge_partials(outs: list[Float[Array, "b hk m d"]], lses: list[Float[Array, "b hk m"]]
                   ) -> Float[Array, "b hk m d"]:
    """Exact softmax over the union of key blocks from per-block (output, lse) pairs."""
    stacked = jnp.stack(lses)
    weights = jnp.exp(stacked - jax.nn.logsumexp(stacked, axis=0))
    return sum(w[..., None] * o for w, o in zip(weights, outs))


def heads_major(x: Float[Array, "b t h d"]) -> Float[Array, "b h t d"]:
    return jnp.swapaxes(x, 1, 2)


def causal_mask(q_positions: Array, k_positions: Array, k_valid: Bool[Array, "*b s"],
                window: int | None) -> Bool[Array, "*b t s"]:
    """``k_valid[s] & pos_k[s] <= pos_q[t]`` (and ``pos_q - pos_k < window`` when sliding)."""
    qp = q_positions[..., :, None]
    kp = k_positions[..., None, :]
    allowed = (kp <= qp) & k_valid[..., None, :]
    if window is not None:
        allowed = allowed & (qp - kp < window)
    return allowed


def attention(q: Float[Array, "b t hq d"], k: Float[Array, "b hk s d"], v: Float[Array, "b hk s d"],
              allowed: Bool[Array, "b t s"]) -> Float[Array, "b t hq d"]:
    """Masked grouped-query attention of a sequence over one head-major block, in ``q.dtype``."""
    b, t, hq, d = q.shape
    hk = k.shape[1]
    r = hq // hk
    qg = q.reshape(b, t, hk, r, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, r * t, d)
    mask = jnp.broadcast_to(allowed[:, None, None], (b, 1, r, t, allowed.shape[-1]))
    out, _ = partial_attention(qg, k, v, mask.reshape(b, 1, r * t, -1))
    return out.reshape(b, hk, r, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def shared_prefix_attention(
    q: Float[Array, "pg hk m d"],
    k: Float[Array, "p hk s d"] | Float[Array, "p hk d s"],
    v: Float[Array, "p hk s d"],
    allowed: Bool[Array, "p #hk #gm s"],
    num_gen: int,
    *,
    k_transposed: bool = False,
) -> tuple[Float[Array, "pg hk m d"], Float[Array, "pg hk m"]]:
    """Attention of the G sequences of each group to their group's ONE prefix block.

    Queries ``[P*G, Hkv, M, D]`` are folded to ``[P, Hkv, G*M, D]`` so the prefix keys are read
    once per group (one dense product per KV head), then unfolded; returns the partial output
    and log-sum-exp for ``merge_partials``. ``allowed`` is over the folded rows ``(g, m)``.
    """
    b, hk, m, d = q.shape
    p = b // num_gen
    qp = q.reshape(p, num_gen, hk, m, d).transpose(0, 2, 1, 3, 4).reshape(p, hk, num_gen * m, d)
    out, lse = partial_attention(qp, k, v, allowed, k_transposed=k_transposed)
    out = out.reshape(p, hk, num_gen, m, d).transpose(0, 2, 1, 3, 4).reshape(b, hk, m, d)
    lse = lse.reshape(p, hk, num_gen, m).transpose(0, 2, 1, 3).reshape(b, hk, m)
    return out, lse
