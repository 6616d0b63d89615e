"""Rows of packed documents through ``relax.models.attention.stream``: the attention hook of a
batch of streams (the block-sparse loop, or one fused kernel over the dense ``allowed`` mask),
and the block pairs of rows packed with whole examples.

A packed row (``relax.models.forward.packed``) holds examples one after the other, then padding;
``segment_ids`` is 0 on padding and the example's index in its row (1, 2, ...) elsewhere. As a
stream, an example is a document with no prompt shared with another::

    docs = segment_ids,   prefix_of = 0,   is_prefix = False

so ``allowed(i, j) = seg_i == seg_j > 0 & pos_j <= pos_i`` (and the window), and the query block
``qb`` meets exactly the key blocks from the one holding the start of its earliest example up to
itself (that example has a slot in every block between)::

    lo(qb) = min over slots i of qb with seg_i > 0 of  (i - pos_i) // block
    pairs  = (qb, kb) for kb = lo(qb) .. qb,   for every block qb holding a real slot

(``i - pos_i`` is the first slot of slot ``i``'s example: positions restart at 0 with every
example); the list is computed on the device, in ``O(T)``, and equals
``stream.block_pairs``' host join for such rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from relax.models.attention.dense import fused_attention_available
from relax.models.attention.stream import (
    StreamMask,
    allowed_mask,
    num_block_pairs,
    stream_attention,
)
from relax.models.config.layer_kinds import layer_window
from relax.models.config.sharding import ambient_batch_shards, decode_layout
from relax.models.decoder.transformer import Attend, Transformer

__all__ = ["masked_attend", "segment_pairs", "segment_stream", "stream_attend"]


def segment_pairs(
    segment_ids: Int[Array, " t"], positions: Int[Array, " t"], block: int
) -> tuple[Int[Array, "w 2"], Int[Array, ""]]:
    """``(pairs [W, 2], num_pairs)`` of one packed row (module docstring; ``positions`` restart at
    0 with every example, ``relax.models.forward.packed.segment_positions``), sorted by query
    block then key block, ``W = num_block_pairs(T, block)``; the entries after ``num_pairs``
    repeat a valid block pair and are never visited."""
    t = segment_ids.shape[0]
    nb = t // block
    first = jnp.arange(t, dtype=jnp.int32) - positions.astype(jnp.int32)
    start_block = jnp.where(segment_ids > 0, first // block, nb)
    lo = jnp.min(start_block.reshape(nb, block), axis=1)
    qb = jnp.arange(nb, dtype=jnp.int32)
    counts = jnp.where(lo < nb, qb - lo + 1, 0)
    ends = jnp.cumsum(counts)
    n = jnp.arange(num_block_pairs(t, block), dtype=jnp.int32)
    q = jnp.minimum(jnp.searchsorted(ends, n, side="right"), nb - 1)
    k = jnp.clip(lo[q] + n - (ends[q] - counts[q]), 0, q)
    return jnp.stack([q, k], axis=-1).astype(jnp.int32), ends[-1].astype(jnp.int32)


def segment_stream(
    segment_ids: Int[Array, "b t"], positions: Int[Array, "b t"], block: int
) -> tuple[StreamMask, Int[Array, "b w 2"], Int[Array, " b"]]:
    """The ``StreamMask`` and block pairs of packed rows (module docstring)."""
    none = jnp.zeros_like(segment_ids, jnp.int32)
    mask = StreamMask(positions, segment_ids, none, none.astype(bool))
    pairs, num_pairs = jax.vmap(functools.partial(segment_pairs, block=block))(
        segment_ids, positions
    )
    return mask, pairs, num_pairs


def stream_attend(
    model: Transformer,
    mask: StreamMask,
    pairs: Int[Array, "b w 2"],
    num_pairs: Int[Array, " b"],
    block: int,
) -> Attend:
    """The attention hook of a batch of streams (``mask`` leaves ``[b, S]``): ``stream_attention``
    per stream (vmapped); on a mesh per shard (``jax.shard_map``: each device loops over its own
    streams' pairs, its KV heads over ``tensor``) when the mesh's batch shards divide them."""
    c = model.config
    probs = model.precision.probs_dtype(model.dtype)
    layout = decode_layout(c)
    local = layout.sharded and mask.docs.shape[0] % ambient_batch_shards() == 0

    def streams(q, k, v, mask, pairs, num_pairs, window):
        one = functools.partial(
            stream_attention, block=block, window=window, scale=c.attn_scale, probs_dtype=probs
        )
        return jax.vmap(one)(q, k, v, mask, pairs, num_pairs)

    if local:
        heads, rows = layout.spec("batch", None, "heads"), layout.spec("batch")
        streams = jax.shard_map(
            streams,
            in_specs=(heads, heads, heads, rows, rows, rows, layout.spec()),
            out_specs=heads,
            check_vma=False,
        )

    def attend(q, k, v, _, sliding):
        window = layer_window(c, sliding)
        window = None if window is None else jnp.asarray(window, jnp.int32)
        out = streams(q, k, v, mask, pairs, num_pairs, window)
        return out.astype(q.dtype), None

    return attend


def masked_attend(model: Transformer, mask: StreamMask) -> Attend:
    """The attention hook of a batch of streams (``mask`` leaves ``[b, S]``) as ONE fused kernel
    per stream over the dense mask (``jax.nn.dot_product_attention``: cuDNN's on a GPU in 16
    bits, XLA's elsewhere)::

        o_i = softmax_j( q_i . k_j * scale  where allowed(i, j)  |  (i = j & docs_i = 0) ) v_j

    the same function as ``stream_attend`` on every real slot: a padding slot sees itself only
    (a fused kernel's row is never empty, so never NaN; the loss reads no padding slot). The
    ``[S, S]`` mask costs ``S^2`` work whatever the documents (``stream_attend``'s follows the
    visible blocks); what wins is one fused kernel instead of a loop of small products (a GPU:
    benchmarks/RESULTS.md). No sliding window (``"dense"`` train attention refuses one)."""
    c = model.config
    impl = "cudnn" if fused_attention_available(model.dtype) else "xla"
    s = mask.docs.shape[-1]
    pad_self = (mask.docs == 0)[..., :, None] & jnp.eye(s, dtype=bool)
    allowed = (allowed_mask(mask) | pad_self)[:, None]  # [b, 1, S, S]: every head

    def attend(q, k, v, _, sliding):
        if layer_window(c, sliding) is not None:
            raise ValueError("masked_attend: no sliding window (use the 'group' train attention)")
        out = jax.nn.dot_product_attention(
            q, k, v, mask=allowed, scale=c.attn_scale, implementation=impl
        )
        return out.astype(q.dtype), None

    return attend
