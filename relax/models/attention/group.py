"""Training-time attention of the G completions of a group over their ONE shared prompt and
their own causal block, one group at a time, with a recomputing (flash-style) backward.

For the queries ``q`` of completion ``g`` (rows ``m``), keys are the group's prompt keys ``K_p``
followed by the completion's own keys ``K_g``; one softmax runs over their union::

    s = [q K_p^T, q K_g^T] * scale   (masked),   lse = logsumexp(s),   P = exp(s - lse)
    o = P [V_p; V_g]

with ``scale = D^-1/2`` unless given (Gemma 3: ``query_pre_attn_scalar^-1/2``).

The backward (``delta = rowsum(dO * O)``)::

    dV = P^T dO,   dS = P * (dO V^T - delta),   dQ = dS K * scale,   dK = dS^T Q * scale

with ``dK_p, dV_p`` summed over the G completions that share the prompt. ``P`` is recomputed
from the saved ``lse`` (flash-style: nothing of score size is kept between the passes) or, with
``save_probabilities``, kept from the forward (``[.., M, Lp+N]`` per layer: one score product and
one exponential pass fewer, forward+backward 11 -> 7.4 ms per layer and group at the train-step
shapes on 2 CPU cores; for cache-sized passes, where that tensor is a few MB). Both passes run as a
``lax.map`` over prompt groups, so the score tiles of one group stay in cache instead of
materialising ``[P*G, Hkv, M, Lp+N]`` scores and every softmax intermediate for the backward
(``benchmarks/train_attention.py``, 2 CPU cores, the train-step shapes: forward 2.6x and
forward+backward 2.2x faster than autodiff of the unblocked form, 6.8x less scratch memory).
The backward concatenates each completion's keys behind a copy of its prompt's, one block.
Masks are rebuilt from positions inside each tile::

    allowed(i, j) = valid_j  &  pos_j <= pos_i  &  (pos_i - pos_j < window, when sliding)

The window is static (one for every layer) or a traced scalar (layers of both kinds scanned
together, ``relax.models.config.layer_kinds``): then it rides with the positions, one per group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.attention.blocks import NEG_INF, causal_mask


def _scores(q, pk, k, masks, scale):
    """Masked scores of one group: prompt part ``[hk, g, m, lp]`` and own part ``[hk, g, m, n]``."""
    sp = jnp.einsum("hgmd,hsd->hgms", q, pk, preferred_element_type=jnp.float32) * scale
    so = jnp.einsum("hgmd,hgsd->hgms", q, k, preferred_element_type=jnp.float32) * scale
    mp, mo = masks
    return jnp.where(mp, sp, NEG_INF), jnp.where(mo, so, NEG_INF)


class _Static(NamedTuple):
    """The kernel's static choices: a static ``window`` (None: none, or the traced one in ``pos``),
    the score ``scale`` (None: ``D^-1/2``), groups per loop step, keep ``P`` for the backward, the
    dtype of ``P`` in the forward's ``P V`` (None: float32)."""

    window: int | None
    scale: float | None
    groups_per_step: int
    save: bool
    probs_dtype: str | None = None


def _scale(st: _Static, q) -> float:
    return q.shape[-1] ** -0.5 if st.scale is None else st.scale


def _group_masks(st: _Static, q_pos, pk_pos, pk_valid, k_pos, k_valid, traced_window):
    # q_pos [g, m]; prompt [lp]; own [g, n] -> [1, g, m, lp], [1, g, m, n]
    window = st.window if traced_window is None else traced_window
    mp = causal_mask(q_pos, pk_pos[None], pk_valid[None], window)[None]
    mo = causal_mask(q_pos, k_pos, k_valid, window)
    return mp, mo[None]


def _group_forward(st, q, pk, pv, k, v, pos):
    scale = _scale(st, q)
    masks = _group_masks(st, *pos)
    sp, so = _scores(q, pk, k, masks, scale)
    m = jnp.maximum(jnp.max(sp, axis=-1), jnp.max(so, axis=-1))[..., None]
    ep = jnp.where(masks[0], jnp.exp(sp - m), 0.0)
    eo = jnp.where(masks[1], jnp.exp(so - m), 0.0)
    l = jnp.sum(ep, axis=-1, keepdims=True) + jnp.sum(eo, axis=-1, keepdims=True)
    safe = jnp.where(l > 0, l, 1.0)
    pd = jnp.float32 if st.probs_dtype is None else jnp.dtype(st.probs_dtype)
    f32 = pd == jnp.float32
    o = (
        jnp.einsum(
            "hgms,hsd->hgmd",
            ep.astype(pd),
            pv.astype(jnp.float32) if f32 else pv.astype(pd),
            preferred_element_type=jnp.float32,
        )
        + jnp.einsum(
            "hgms,hgsd->hgmd",
            eo.astype(pd),
            v.astype(jnp.float32) if f32 else v.astype(pd),
            preferred_element_type=jnp.float32,
        )
    ) / safe
    lse = jnp.where(l > 0, m + jnp.log(safe), jnp.inf)  # +inf: P = exp(s - lse) = 0 in the backward
    return o, lse, (ep, eo, safe)


def _group_forward_saving(st, q, pk, pv, k, v, pos):
    """The forward that also returns ``P`` over ``[prompt; own]`` keys, ``[hk, g, m, lp+n]``."""
    o, _, (ep, eo, safe) = _group_forward(st, q, pk, pv, k, v, pos)
    return o, jnp.concatenate([ep, eo], axis=-1) * (1.0 / safe)


def _with_prompt(pk, k):
    """``[hk, lp, d]`` prompt rows in front of every completion's ``[hk, g, n, d]`` rows: ``[hk, g, lp+n, d]``."""
    hk, g = k.shape[:2]
    return jnp.concatenate(
        [jnp.broadcast_to(pk[:, None], (hk, g) + pk.shape[1:]).astype(k.dtype), k], axis=2
    )


def _group_backward(st, q, pk, pv, k, v, pos, o, lse, do):
    """The backward with ``P`` recomputed from the saved log-sum-exp."""
    scale = _scale(st, q)
    mp, mo = _group_masks(st, *pos)
    mask = jnp.concatenate([jnp.broadcast_to(mp, mo.shape[:-1] + mp.shape[-1:]), mo], axis=-1)
    kk = _with_prompt(pk, k).astype(jnp.float32)
    s = jnp.where(mask, jnp.einsum("hgmd,hgsd->hgms", q.astype(jnp.float32), kk) * scale, NEG_INF)
    pr = jnp.exp(s - lse)  # masked entries: exp(-1e30 - lse) = 0
    return _backward_from_probs(st, q, pk, pv, k, v, o, pr, do, kk=kk)


def _backward_from_probs(st, q, pk, pv, k, v, o, pr, do, kk=None):
    # One [lp+n]-wide block per completion (the prompt keys copied G times, a few KB) instead of a
    # prompt block and an own block: half the matmuls and fusions, ~25% faster on CPU
    # (benchmarks/train_attention.py); the prompt gradients are the G copies' sum. ``kk``: the
    # float32 [prompt; own] keys when the caller has built them already.
    scale = _scale(st, q)
    f32 = jnp.float32
    lp = pk.shape[1]
    kk = _with_prompt(pk, k).astype(f32) if kk is None else kk
    vv, qf = _with_prompt(pv, v).astype(f32), q.astype(f32)
    delta = jnp.sum(do * o, axis=-1, keepdims=True)
    dvv = jnp.einsum("hgms,hgmd->hgsd", pr, do)
    ds = pr * (jnp.einsum("hgmd,hgsd->hgms", do, vv) - delta) * scale
    dq = jnp.einsum("hgms,hgsd->hgmd", ds, kk)
    dkk = jnp.einsum("hgms,hgmd->hgsd", ds, qf)
    return (
        dq.astype(q.dtype),
        jnp.sum(dkk[:, :, :lp], axis=1).astype(pk.dtype),
        jnp.sum(dvv[:, :, :lp], axis=1).astype(pv.dtype),
        dkk[:, :, lp:].astype(k.dtype),
        dvv[:, :, lp:].astype(v.dtype),
    )


def _tiles(b, x):
    """``[P, ...] -> [P/b, b, ...]``: loop step i takes groups ``i, i + P/b, i + 2P/b, ...``, so with
    the P axis block-sharded over b devices every step works on one local group per device."""
    return x.reshape((b, x.shape[0] // b) + x.shape[1:]).swapaxes(0, 1)


def _untile(x):
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _over_groups(fn, b, *xs):
    """``fn`` per group: a ``lax.map`` over P/b steps of ``b`` groups each (vmapped)."""
    if b == 1:  # no tiling: the [P/b, b] reshapes would cost a copy of every input and output
        return jax.lax.map(lambda a: fn(*a), xs)
    out = jax.lax.map(jax.vmap(lambda a: fn(*a)), jax.tree.map(functools.partial(_tiles, b), xs))
    return jax.tree.map(_untile, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st, q, pk, pv, k, v, pos):
    return _over_groups(
        lambda *a: _group_forward(st, *a)[0], st.groups_per_step, q, pk, pv, k, v, pos
    )


def _attend_fwd(st, q, pk, pv, k, v, pos):
    b = st.groups_per_step
    if st.save:  # residual: P itself
        o, kept = _over_groups(
            functools.partial(_group_forward_saving, st), b, q, pk, pv, k, v, pos
        )
    else:  # residual: the log-sum-exp
        o, kept = _over_groups(lambda *a: _group_forward(st, *a)[:2], b, q, pk, pv, k, v, pos)
    return o, (q, pk, pv, k, v, pos, o, kept)


def _attend_bwd(st, res, do):
    q, pk, pv, k, v, pos, o, kept = res
    do = do.astype(jnp.float32)
    b = st.groups_per_step
    if st.save:
        grads = _over_groups(
            functools.partial(_backward_from_probs, st), b, q, pk, pv, k, v, o, kept, do
        )
    else:
        grads = _over_groups(
            functools.partial(_group_backward, st), b, q, pk, pv, k, v, pos, o, kept, do
        )
    return (*grads, jax.tree.map(lambda _: None, pos))


_attend.defvjp(_attend_fwd, _attend_bwd)


def prefix_group_attention(
    q: Float[Array, "p hk g m d"],
    pk: Float[Array, "p hk lp d"],
    pv: Float[Array, "p hk lp d"],
    k: Float[Array, "p hk g n d"],
    v: Float[Array, "p hk g n d"],
    q_pos: Int[Array, "p g m"],
    p_pos: Int[Array, "p lp"],
    p_valid: Bool[Array, "p lp"],
    k_pos: Int[Array, "p g n"],
    k_valid: Bool[Array, "p g n"],
    *,
    window: int | Int[Array, ""] | None = None,
    scale: float | None = None,
    groups_per_step: int = 1,
    save_probabilities: bool = False,
    probs_dtype=None,
) -> Float[Array, "p hk g m d"]:
    """Softmax attention of each completion's query rows over [its group's prompt; its own keys].

    Layouts are KV-head-major (``[P, Hkv, G, ...]``) so that the prompt product of a group is one
    ``[G*M, D] x [D, Lp]`` matmul per head with no transpose of its scores.
    ``m`` query rows per KV head (e.g. ``R`` query heads times ``N`` positions), positions are
    absolute (prompt positions ``p_pos``, completion positions continuing after the prompt).
    Returns float32; rows that see no key give zeros. Differentiable in ``q, pk, pv, k, v``.
    ``window``: static, or a traced int32 scalar (module docstring); ``scale``: of the scores
    (None: ``D^-1/2``).

    ``groups_per_step``: groups computed together per loop step (it must divide P). 1 keeps each
    tile in cache (CPU); on a mesh pass the number of shards of the P axis, so that each step
    takes one local group per device (a loop over a sharded axis would gather it); P = no loop.

    ``save_probabilities``: keep ``P`` (``[P, Hkv, G, M, Lp+N]`` float32) from the forward for the
    backward instead of recomputing it - faster, at the cost of that memory per layer until the
    backward; the result and gradients are the same either way.

    ``probs_dtype``: of ``P`` in the forward's ``P V`` (None: float32, ``V`` upcast); the backward
    recomputes in float32 either way.
    """
    p = q.shape[0]
    if groups_per_step < 1 or p % groups_per_step:
        raise ValueError(f"groups_per_step={groups_per_step} does not divide the {p} prompt groups")
    traced = window is not None and not isinstance(window, int)
    per_group = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (p,)) if traced else None
    pos = (
        q_pos,
        p_pos,
        p_valid.astype(bool),
        k_pos,
        k_valid.astype(bool),
        per_group,
    )
    pd = None if probs_dtype is None else jnp.dtype(probs_dtype).name
    st = _Static(None if traced else window, scale, groups_per_step, bool(save_probabilities), pd)
    return _attend(st, q, pk, pv, k, v, pos)
