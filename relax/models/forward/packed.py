"""The packed training forward: several examples per row, each as if it were alone.

A packed row holds whole examples one after the other, then padding; ``segment_ids [B, T]``
says which (0 = padding, 1, 2, ... = the example's index in its row, each example one
contiguous run of positions). Attention never crosses an example boundary and positions restart
at 0 with every example, so RoPE sees each example exactly as it would alone::

    allowed[b, i, j] = seg[b, i] == seg[b, j] > 0  &  j <= i  (&  i - j < window on sliding layers)
    pos[b, t]        = t - (first index of seg[b, t] in row b)

so per-example log-probs and their gradients equal those of the example run by itself
(``relax.models.decoder.logprobs.token_logprobs``) up to float summation order. The attention
is one of two (``block``, the backend's ``relax.passes.Passes.rows_block()``):

- ``block`` an int: each row is a stream of its examples for ``relax.models.attention.stream``,
  which visits only the ``block x block`` tiles that hold a visible key and keeps no ``[T, T]``
  array for the backward, so its cost and memory follow ``sum len^2`` of the examples, not
  ``T^2`` (``relax.models.forward.stream_rows``; the rows padded inside to a multiple of
  ``block``);
- ``block=None``: the dense ``[B, T, T]`` mask (one per layer kind) and the same masked
  grouped-query attention as ``relax.models.decoder.transformer.full_attention``.

Log-probs go through the chunked head
(``relax.models.decoder.logprobs.logprobs_from_hidden``): no ``[B, T, V]`` float32 array exists.

At the last token of an example, the "next token" is the first token of the next example (or
padding): that log-prob is meaningless, and a training loss must mask it (``relax.data.supervised``
never marks an example's first token as a target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.attention import blocks as attn
from relax.models.config.layer_kinds import layer_window, select
from relax.models.decoder.logprobs import DEFAULT_CHUNK, logprobs_from_hidden
from relax.models.decoder.transformer import Attend, LayerRoutes, Transformer, embed, run_layers
from relax.models.forward.stream_rows import segment_stream, stream_attend
from relax.models.moe.experts import RouterStats

__all__ = [
    "greedy_hits",
    "packed_attention",
    "packed_hidden",
    "packed_logprobs",
    "segment_mask",
    "segment_positions",
]


def segment_positions(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """Each token's position within its own example (0 at the example's first token; padding
    gets the position it would have as a continuation of what precedes it, and is masked)."""
    t = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    prev = jnp.concatenate(
        [jnp.full(segment_ids.shape[:-1] + (1,), -1, segment_ids.dtype), segment_ids[..., :-1]],
        axis=-1,
    )
    starts = jnp.where(segment_ids != prev, idx, 0)
    return idx - jax.lax.cummax(starts, axis=segment_ids.ndim - 1)


def segment_mask(
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    window: int | Int[Array, ""] | None,
) -> Bool[Array, "b t t"]:
    """``allowed[b, i, j]``: key ``j`` is visible to query ``i`` (same example, causal, within
    ``window``); padding sees nothing and is seen by nothing."""
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    return attn.causal_mask(positions, positions, segment_ids > 0, window) & same


def packed_attention(
    model: Transformer,
    segment_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    block: int | None,
) -> Attend:
    """The attention hook of packed rows (module docstring): block-sparse over each row's
    streamed examples (``T`` a multiple of ``block``), or dense with the segment mask
    (``block=None``; the masks of both layer kinds built once); returns no per-layer output."""
    if block is not None:
        mask, pairs, num_pairs = segment_stream(segment_ids, positions, block)
        return stream_attend(model, mask, pairs, num_pairs, block)
    c = model.config
    probs = model.precision.probs_dtype(model.dtype)
    masks = {
        s: segment_mask(segment_ids, positions, layer_window(c, s)) for s in set(c.sliding_layers)
    }

    def attend(q, k, v, _, sliding):
        allowed = (
            masks[sliding]
            if isinstance(sliding, bool)
            else select(sliding, masks[True], masks[False])
        )
        k, v = attn.heads_major(k), attn.heads_major(v)
        return attn.attention(q, k, v, allowed, scale=c.attn_scale, probs_dtype=probs), None

    return attend


def packed_hidden(
    model: Transformer,
    ids: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    *,
    remat: bool = False,
    block: int | None = None,
) -> Float[Array, "b t D"]:
    """Final-norm hidden states of packed rows (module docstring); ``remat`` recomputes each
    layer in the backward pass; ``block``: the block-sparse attention's tile, None for the dense
    one (the backend's choice: ``relax.passes.Passes.rows_block()``)."""
    return packed_hidden_routed(model, ids, segment_ids, remat=remat, block=block)[0]


def packed_hidden_routed(
    model: Transformer,
    ids: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    *,
    remat: bool = False,
    block: int | None = None,
) -> tuple[Float[Array, "b t D"], RouterStats | None]:
    """``packed_hidden`` and a mixture of experts' ``RouterStats`` over the rows' tokens (stacked
    ``[Ls]``; None for a dense model)."""
    t = ids.shape[-1]
    pad = ((0, 0), (0, 0 if block is None else -t % block))  # padding: segment 0, unseen
    ids, segment_ids = jnp.pad(ids, pad), jnp.pad(segment_ids, pad)
    positions = segment_positions(segment_ids)
    attend = packed_attention(model, segment_ids, positions, block)
    h, _, routed = run_layers(
        model,
        embed(model, ids),
        positions,
        attend,
        remat=remat,
        routes=LayerRoutes(segment_ids > 0),
    )
    return h[:, :t], None if routed is None else routed.stats


def packed_logprobs(
    model: Transformer,
    ids: Int[Array, "b t"],
    segment_ids: Int[Array, "b t"],
    *,
    temperature: float = 1.0,
    remat: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    block: int | None = None,
) -> Float[Array, "b t-1"]:
    """``out[:, t] = log p(ids[:, t+1] | the example's tokens up to t)`` (float32), examples
    isolated from each other. Only positions where ``t+1`` continues the example at ``t`` are
    meaningful (mask with a loss mask that is 0 on every example's first token)."""
    h = packed_hidden(model, ids, segment_ids, remat=remat, block=block)
    return logprobs_from_hidden(
        model, h[:, :-1], ids[:, 1:], temperature=temperature, chunk_size=chunk_size
    )


def greedy_hits(
    model: Transformer,
    h: Float[Array, "*b D"],
    targets: Int[Array, "*b"],
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> Bool[Array, "*b"]:
    """Whether ``targets`` is the argmax of the logits ``h W^T`` (a stop-gradient metric: the
    next-token accuracy), computed ``chunk_size`` rows at a time like the log-probs."""
    w = jax.lax.stop_gradient(model.head.astype(model.dtype))
    lead = targets.shape
    h = jax.lax.stop_gradient(h).reshape(-1, h.shape[-1])
    y = targets.reshape(-1)

    def hits(hc, yc):
        z = jnp.einsum("nd,vd->nv", hc, w, preferred_element_type=jnp.float32)
        return jnp.argmax(z, axis=-1) == yc

    n = h.shape[0]
    if n <= chunk_size:
        return hits(h, y).reshape(lead)
    pad = (-n) % chunk_size
    hc = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk_size, h.shape[-1])
    yc = jnp.pad(y, (0, pad)).reshape(-1, chunk_size)
    return jax.lax.map(lambda xs: hits(*xs), (hc, yc)).reshape(-1)[:n].reshape(lead)
