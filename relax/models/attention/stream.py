"""Block-sparse attention over a packed stream of prompts and completions, with a recomputing
(flash-style) backward; the cost follows the allowed blocks, not ``S x S``.

A stream is one row of ``S`` slots holding documents one after the other: prompts and their
completions, then padding. Per slot (``StreamMask``): ``positions`` (RoPE positions: a prompt's
tokens ``0..len-1``, its completion's token ``t`` at ``len + t``), ``docs`` (0: padding, > 0 the
document's id), ``prefix_of`` (the id of the prompt the token belongs to) and ``is_prefix`` (a
prompt token). A completion sees its prompt and its own earlier tokens, a prompt its own earlier
tokens::

    allowed(i, j) = docs_i > 0  &  docs_j > 0  &  pos_j <= pos_i  &  (pos_i - pos_j < window)
                    &  (docs_j == docs_i  |  (is_prefix_j  &  prefix_of_j == prefix_of_i))

The caller guarantees that every allowed ``(i, j)`` has ``j <= i`` in slot order (a prompt lies
before its completions, documents are contiguous runs). Grouped-query attention (query head
``h`` uses KV head ``h // R``, ``R = Hq / Hkv``)::

    s_ij = q_i . k_j * scale  (masked by allowed),   o_i = sum_j softmax_j(s_ij) v_j

with ``scale = D^-1/2`` unless given; a row that sees no key gives 0.

The slots are cut into blocks of ``block``. ``block_pairs`` (host, numpy) lists the (query
block, key block) pairs holding an allowed entry; the forward is one ``lax.fori_loop`` over
those ``num_pairs`` pairs only, carrying the running row max ``m``, row sum ``l`` and
unnormalised output ``o`` (float32, full size) and updating one query block per step by the
online-softmax rescaling::

    m' = max(m, max_j s_ij),   l' = e^(m - m') l + sum_j e^(s_ij - m'),
    o' = e^(m - m') o + sum_j e^(s_ij - m') v_j;      finally o / l,  lse = m + log l

The backward (``delta = rowsum(dO * O)``, one more loop over the same pairs)::

    P = exp(s - lse),  dV_k += P^T dO_q,  dS = P * (dO_q V_k^T - delta),
    dQ_q += dS K_k * scale,  dK_k += dS^T Q_q * scale

Under ``jax.vmap`` (a batch of streams, e.g. the bins of an update) both loops run the batch as
ONE stream of ``B S`` slots (``jax.custom_batching.custom_vmap``): every stream's real pairs laid
end to end, stream ``b``'s blocks shifted by ``b S / block``, so each step still slices one
block pair. Plain batching would run ``max num_pairs`` steps whose slices are gathers and
scatters: forward+backward ~4x slower on CPU at S = 2048.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from relax.models.attention.blocks import NEG_INF


class StreamMask(NamedTuple):
    """Per-slot metadata of a stream, each ``[S]`` (``[B, S]`` where batched by vmap)."""

    positions: Int[Array, " s"]
    docs: Int[Array, " s"]
    prefix_of: Int[Array, " s"]
    is_prefix: Bool[Array, " s"]


def num_block_pairs(s: int, block: int) -> int:
    """``W = nb (nb + 1) / 2``, ``nb = s / block``: every causal block pair, the padded (static)
    length of ``block_pairs``' list."""
    nb = _num_blocks(s, block)
    return nb * (nb + 1) // 2


def _num_blocks(s: int, block: int) -> int:
    if block < 1 or s % block:
        raise ValueError(f"block={block} must be positive and divide the stream length S={s}")
    return s // block


def block_pairs(docs, prefix_of, is_prefix, block: int) -> tuple[np.ndarray, int]:
    """The ``(query block, key block)`` pairs with an allowed entry (window ignored: a superset).

    numpy, on the host. Returns ``pairs [W, 2]`` int32 sorted by query block then key block,
    padded to ``W = num_block_pairs(S, block)`` with copies of the last real pair (``(0, 0)``
    when there is none), and the number of real pairs. Exact for the layout the module
    docstring describes (positions rise along each document, a prompt's below its completions'):
    a pair is listed iff some ``(i, j)`` in it is allowed. With the slot order standing in for
    the positions, query slot ``i`` and key slot ``j <= i`` meet iff they share a *tag*::

        tags_q(i) = {doc docs_i, prompt prefix_of_i}     (docs_i > 0)
        tags_k(j) = {doc docs_j} + {prompt prefix_of_j if is_prefix_j}     (docs_j > 0)

    so the pairs are a join on tags of the (tag, block) entries of both sides, kept where
    ``key block <= query block``: vectorised, ``O(S log S + pairs)``, no ``S x S`` array.
    """
    docs, prefix_of, is_prefix = (np.asarray(x).reshape(-1) for x in (docs, prefix_of, is_prefix))
    s = docs.shape[0]
    if prefix_of.shape != (s,) or is_prefix.shape != (s,):
        raise ValueError(
            f"block_pairs: docs {docs.shape}, prefix_of {prefix_of.shape} and is_prefix "
            f"{is_prefix.shape} must all be [S]"
        )
    nb = _num_blocks(s, block)
    width = num_block_pairs(s, block)
    q_entries, k_entries = _tag_entries(docs, prefix_of, is_prefix.astype(bool), block, nb)
    codes = _join(q_entries, k_entries, nb)
    count = codes.shape[0]
    pairs = np.zeros((width, 2), np.int32)
    if count:
        pairs[:count, 0], pairs[:count, 1] = np.divmod(codes, nb)
        pairs[count:] = pairs[count - 1]
    return pairs, count


def _tag_entries(docs, prefix_of, is_prefix, block, nb):
    """Sorted unique ``tag * nb + block`` codes of the query side and of the key side; a doc's
    tag is ``2 id``, a prompt's ``2 id + 1``."""
    valid = docs > 0
    blk = (np.arange(docs.shape[0]) // block)[valid]
    doc_tags = 2 * docs[valid].astype(np.int64)
    prompt_tags = 2 * prefix_of[valid].astype(np.int64) + 1
    q = np.concatenate([doc_tags, prompt_tags]) * nb + np.concatenate([blk, blk])
    key_prompt = is_prefix[valid]
    k = np.concatenate([doc_tags, prompt_tags[key_prompt]]) * nb + np.concatenate(
        [blk, blk[key_prompt]]
    )
    return np.unique(q), np.unique(k)


def _join(q_entries, k_entries, nb):
    """Sorted unique ``query block * nb + key block`` codes of the entries sharing a tag with
    ``key block <= query block``: for each query entry ``(t, b)`` the key entries from
    ``(t, 0)`` up to ``(t, b)``, one contiguous run of the sorted key codes."""
    tag = np.floor_divide(q_entries, nb)
    lo = np.searchsorted(k_entries, tag * nb, side="left")
    hi = np.searchsorted(k_entries, q_entries, side="right")
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total == 0:
        return np.zeros((0,), np.int64)
    ends = np.cumsum(counts)
    offsets = np.arange(total) - np.repeat(ends - counts, counts)
    keys = k_entries[np.repeat(lo, counts) + offsets] % nb
    queries = np.repeat(q_entries % nb, counts)
    return np.unique(queries * nb + keys)


class _Static(NamedTuple):
    """The kernel's static choices: ``block``, the score ``scale`` (None: ``D^-1/2``), the dtype
    of ``P`` in the forward's ``P V`` (None: float32), whether a window is given."""

    block: int
    scale: float | None
    probs_dtype: str | None
    windowed: bool


def _heads(x: Float[Array, "s hq *d"], hk: int) -> Float[Array, "hk r s *d"]:
    """Slot-major ``[S, Hq, ...]`` to ``[Hkv, R, S, ...]`` (query head ``h = kv R + r``)."""
    s, hq = x.shape[:2]
    grouped = x.reshape((s, hk, hq // hk) + x.shape[2:])
    return jnp.moveaxis(grouped, 0, 2)


def _unheads(x: Float[Array, "hk r s *d"]) -> Float[Array, "s hq *d"]:
    hk, r, s = x.shape[:3]
    return jnp.moveaxis(x, 2, 0).reshape((s, hk * r) + x.shape[3:])


def _slice(x, start, block, axis):
    return lax.dynamic_slice_in_dim(x, start, block, axis=axis)


def _put(x, update, start, axis):
    return lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _allowed(q: StreamMask, k: StreamMask) -> Bool[Array, "..."]:
    """``allowed(i, j)`` (module docstring, no window) of query slots ``q`` and key slots ``k``,
    broadcast against each other."""
    ok = (q.docs > 0) & (k.docs > 0) & (k.positions <= q.positions)
    return ok & ((k.docs == q.docs) | (k.is_prefix & (k.prefix_of == q.prefix_of)))


def allowed_mask(mask: StreamMask) -> Bool[Array, "*b s s"]:
    """Every slot pair's ``allowed(i, j)`` (module docstring, no window), ``[..., S, S]``: the
    dense form, for kernels that take a mask (``relax.models.forward.stream_rows``)."""
    return _allowed(
        StreamMask(*(x[..., :, None] for x in mask)), StreamMask(*(x[..., None, :] for x in mask))
    )


def _pair_allowed(st: _Static, mask: StreamMask, window, qs, ks) -> Bool[Array, "b b"]:
    """``allowed(i, j)`` (module docstring) for the query block at slot ``qs`` and the key block
    at slot ``ks``; ``window`` a scalar or one per slot (streams flattened by the vmap rule)."""
    q = StreamMask(*(_slice(x, qs, st.block, 0)[:, None] for x in mask))
    k = StreamMask(*(_slice(x, ks, st.block, 0)[None, :] for x in mask))
    ok = _allowed(q, k)
    if st.windowed:
        w = _slice(window, qs, st.block, 0)[:, None] if window.ndim else window
        ok = ok & (q.positions - k.positions < w)
    return ok


def _pair_scores(st, qh, kh, mask, window, qs, ks, scale):
    """Masked scores ``[hk, r, b, b]`` of one block pair, all heads at once, and the pair's mask."""
    q_blk = _slice(qh, qs, st.block, 2)
    k_blk = _slice(kh, ks, st.block, 1)
    s = jnp.einsum("hrqd,hkd->hrqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    allowed = _pair_allowed(st, mask, window, qs, ks)
    return jnp.where(allowed, s, NEG_INF), allowed


def _scale(st: _Static, q) -> float:
    return q.shape[-1] ** -0.5 if st.scale is None else st.scale


def _starts(st: _Static, pairs, n):
    return pairs[n, 0] * st.block, pairs[n, 1] * st.block


def _forward(st, q, k, v, mask, pairs, num_pairs, window):
    """Normalised output ``[S, Hq, D]`` and ``lse [S, Hq]`` (+inf where nothing is seen), float32."""
    hk = k.shape[1]
    qh, kh = _heads(q, hk), k.transpose(1, 0, 2)
    pd = jnp.float32 if st.probs_dtype is None else jnp.dtype(st.probs_dtype)
    vh = v.transpose(1, 0, 2).astype(pd)  # float32 P: V upcast, as in group._group_forward
    scale = _scale(st, q)

    def step(n, carry):
        m, l, o = carry
        qs, ks = _starts(st, pairs, n)
        s, allowed = _pair_scores(st, qh, kh, mask, window, qs, ks, scale)
        m_old, l_old, o_old = (_slice(x, qs, st.block, 2) for x in carry)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
        p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_old - m_new)
        pv = jnp.einsum(
            "hrqk,hkd->hrqd",
            p.astype(pd),
            _slice(vh, ks, st.block, 1),
            preferred_element_type=jnp.float32,
        )
        return (
            _put(m, m_new, qs, 2),
            _put(l, alpha * l_old + jnp.sum(p, axis=-1), qs, 2),
            _put(o, alpha[..., None] * o_old + pv, qs, 2),
        )

    rows = qh.shape[:3]
    init = (
        jnp.full(rows, NEG_INF, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros(qh.shape, jnp.float32),
    )
    m, l, o = lax.fori_loop(0, num_pairs, step, init)
    safe = jnp.where(l > 0, l, 1.0)
    lse = jnp.where(l > 0, m + jnp.log(safe), jnp.inf)  # +inf: P = exp(s - lse) = 0 backward
    return _unheads(o / safe[..., None]), _unheads(lse)


def _backward(st, q, k, v, mask, pairs, num_pairs, window, o, lse, do):
    """``dq [S, Hq, D]``, ``dk, dv [S, Hkv, D]`` (float32) by one loop over the pairs; ``o``,
    ``lse`` from ``_forward``, ``do`` float32."""
    f32 = jnp.float32
    hk = k.shape[1]
    qh, kh, vh = _heads(q, hk).astype(f32), k.transpose(1, 0, 2).astype(f32), v.transpose(1, 0, 2)
    vh, doh, lse = vh.astype(f32), _heads(do, hk), _heads(lse, hk)
    delta = _heads(jnp.sum(do * o, axis=-1), hk)
    scale = _scale(st, q)

    def step(n, carry):
        dq, dk, dv = carry
        qs, ks = _starts(st, pairs, n)
        s, allowed = _pair_scores(st, qh, kh, mask, window, qs, ks, scale)
        p = jnp.where(allowed, jnp.exp(s - _slice(lse, qs, st.block, 2)[..., None]), 0.0)
        do_q = _slice(doh, qs, st.block, 2)
        dp = jnp.einsum("hrqd,hkd->hrqk", do_q, _slice(vh, ks, st.block, 1))
        ds = p * (dp - _slice(delta, qs, st.block, 2)[..., None]) * scale
        dq_blk = jnp.einsum("hrqk,hkd->hrqd", ds, _slice(kh, ks, st.block, 1))
        dk_blk = jnp.einsum("hrqk,hrqd->hkd", ds, _slice(qh, qs, st.block, 2))
        dv_blk = jnp.einsum("hrqk,hrqd->hkd", p, do_q)
        return (
            _put(dq, _slice(dq, qs, st.block, 2) + dq_blk, qs, 2),
            _put(dk, _slice(dk, ks, st.block, 1) + dk_blk, ks, 1),
            _put(dv, _slice(dv, ks, st.block, 1) + dv_blk, ks, 1),
        )

    init = (jnp.zeros(qh.shape, f32), jnp.zeros(kh.shape, f32), jnp.zeros(vh.shape, f32))
    dq, dk, dv = lax.fori_loop(0, num_pairs, step, init)
    return _unheads(dq), dk.transpose(1, 0, 2), dv.transpose(1, 0, 2)


def _flat_pairs(pairs: Int[Array, "b w 2"], num_pairs: Int[Array, " b"], nb: int):
    """The real pairs of ``b`` streams laid end to end (``S * b`` slots), first in the list:
    stream ``i``'s block ``x`` is block ``i nb + x``. Returns the list ``[b w, 2]`` and its count."""
    b, w = pairs.shape[:2]
    real = (jnp.arange(w)[None] < num_pairs[:, None]).reshape(-1)
    shifted = (pairs + (jnp.arange(b, dtype=pairs.dtype) * nb)[:, None, None]).reshape(-1, 2)
    order = jnp.argsort(~real, stable=True)
    return shifted[order], jnp.sum(real, dtype=jnp.int32)


def _vmap_rule(fn, st, axis_size, in_batched, q, k, v, mask, pairs, num_pairs, window, *rest):
    """A batch of streams run as ONE stream of ``B S`` slots (no pair crosses streams, so the
    masks need no change): one loop over every stream's real pairs, with unbatched slices,
    instead of a batched loop of ``max num_pairs`` steps whose slices become gathers and
    scatters (~4x slower forward+backward on CPU). ``rest``: the backward's slot-major inputs."""
    grow = lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
    q, k, v, mask, pairs, num_pairs, *rest = jax.tree.map(
        grow, (q, k, v, mask, pairs, num_pairs, *rest), (*in_batched[:6], *in_batched[7:])
    )
    s = q.shape[1]
    flat = lambda x: x.reshape((axis_size * s,) + x.shape[2:])
    if st.windowed and (in_batched[6] or window.ndim):  # one per stream (or slot): one per slot
        window = grow(window, in_batched[6]).reshape(axis_size, -1)
        window = flat(jnp.broadcast_to(window, (axis_size, s)))
    pairs, total = _flat_pairs(pairs, num_pairs, s // st.block)
    args = (*map(flat, (q, k, v)), jax.tree.map(flat, mask), pairs, total, window)
    out = fn(*args, *map(flat, rest))
    unflat = lambda x: x.reshape((axis_size, s) + x.shape[1:])
    return jax.tree.map(unflat, out), jax.tree.map(lambda _: True, out)


@functools.cache
def _batchable(kernel, st: _Static):
    """``kernel(st, ...)`` batched by ``_vmap_rule`` (nested vmaps flatten again)."""
    fn = jax.custom_batching.custom_vmap(functools.partial(kernel, st))
    fn.def_vmap(functools.partial(_vmap_rule, fn, st))
    return fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stream(st, q, k, v, mask, pairs, num_pairs, window):
    return _batchable(_forward, st)(q, k, v, mask, pairs, num_pairs, window)[0]


def _stream_fwd(st, q, k, v, mask, pairs, num_pairs, window):
    o, lse = _batchable(_forward, st)(q, k, v, mask, pairs, num_pairs, window)
    return o, (q, k, v, mask, pairs, num_pairs, window, o, lse)


def _stream_bwd(st, res, g):
    q, k, v, mask, pairs, num_pairs, window, o, lse = res
    dq, dk, dv = _batchable(_backward, st)(
        q, k, v, mask, pairs, num_pairs, window, o, lse, g.astype(jnp.float32)
    )
    none = jax.tree.map(lambda _: None, mask)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), none, None, None, None


_stream.defvjp(_stream_fwd, _stream_bwd)


def stream_attention(
    q: Float[Array, "s hq d"],
    k: Float[Array, "s hk d"],
    v: Float[Array, "s hk d"],
    mask: StreamMask,
    pairs: Int[Array, "w 2"],
    num_pairs: Int[Array, ""],
    *,
    block: int,
    window: int | Int[Array, ""] | None = None,
    scale: float | None = None,
    probs_dtype=None,
) -> Float[Array, "s hq d"]:
    """Grouped-query attention of a packed stream over its allowed keys (module docstring),
    float32; rows that see no key give 0. Differentiable in ``q, k, v`` (custom backward).

    ``pairs`` / ``num_pairs``: from ``block_pairs`` with the same ``block``; only the first
    ``num_pairs`` pairs are visited (the rest may hold anything). ``window``: static, or a traced
    int32 scalar (layers of both kinds scanned together); None: none. ``scale``: of the scores
    (None: ``D^-1/2``). ``probs_dtype``: of ``P`` in the forward's ``P V`` (None: float32, ``V``
    upcast); the backward recomputes in float32 either way. Vmaps over a leading batch axis of
    any arguments: a batch of streams runs as one stream, ``sum num_pairs`` steps (module
    docstring).
    """
    s, hq, _ = q.shape
    hk = k.shape[1]
    _num_blocks(s, block)
    if k.shape[0] != s or v.shape != k.shape or hq % hk:
        raise ValueError(
            f"stream_attention: q {q.shape}, k {k.shape}, v {v.shape}: need [S, Hq, D], "
            "[S, Hkv, D], [S, Hkv, D] with Hkv dividing Hq"
        )
    for name, x in zip(StreamMask._fields, mask):
        if x.shape != (s,):
            raise ValueError(f"stream_attention: mask.{name} has shape {x.shape}, not [S]=({s},)")
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"stream_attention: pairs has shape {pairs.shape}, not [W, 2]")
    mask = StreamMask(
        jnp.asarray(mask.positions, jnp.int32),
        jnp.asarray(mask.docs, jnp.int32),
        jnp.asarray(mask.prefix_of, jnp.int32),
        jnp.asarray(mask.is_prefix, bool),
    )
    pd = None if probs_dtype is None else jnp.dtype(probs_dtype).name
    st = _Static(block, scale, pd, window is not None)
    w = jnp.asarray(0 if window is None else window, jnp.int32)
    pairs = jnp.asarray(pairs, jnp.int32)
    return _stream(st, q, k, v, mask, pairs, jnp.asarray(num_pairs, jnp.int32), w)
