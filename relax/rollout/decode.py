"""The decode loop's pieces: the weights' decode layout, the decode attention, the phase rows.

``place_layer`` / ``place_model`` lay the fused weights and the embedding out once before the
loop (``relax.models.config.sharding.DecodeLayout``); ``attention_kernel`` and ``decode_attend``
are the attention of one new token per completion over the shared prompt and its own cache
blocks; :class:`Rows`, ``compact`` and ``write_back`` carry a compaction phase's rows and gather
them into the next phase (``relax.rollout.compaction``). ``relax.rollout.sampler`` assembles them
into its program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.attention.decode import (
    pallas_available,
    pallas_decode_attention,
    reference_decode_attention,
)
from relax.models.config.layer_kinds import layer_window
from relax.models.config.sharding import DecodeLayout
from relax.models.decoder.layer import FusedLayer
from relax.models.decoder.transformer import Transformer
from relax.models.layers.quantized import is_quantized
from relax.rollout.compaction import keep_rows

# logical dims of the fused weights on a mesh (the rest, norms, output biases, a sparse layer's
# router and shared expert, replicated); a sparse layer's experts split over ``expert`` (their
# units over ``tensor``), as the expert-parallel step reads them (relax.models.moe.expert_parallel)
_FUSED_DIMS = {
    "wqkv": (None, "heads"),
    "bqkv": ("heads",),
    "wo": ("heads", None),
    "w_gate_up": (None, "mlp"),
    "b_gate_up": ("mlp",),
    "w_down": ("mlp", None),
    "expert_gate": ("experts", None, "expert_mlp"),
    "expert_up": ("experts", None, "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", None),
}


def place_layer(layout: DecodeLayout, p: FusedLayer) -> FusedLayer:
    """One fused layer in the decode layout (adapters left where they are; an 8-bit weight,
    ``relax.models.layers.quantized``: its values as the weight, its scales likewise)."""

    def place(name):
        x = getattr(p, name)
        if name == "lora" or not (
            eqx.is_array(x) or is_quantized(x)
        ):  # adapters, absent biases, the static group counts
            return x
        dims = _FUSED_DIMS.get(name, (None,) * x.ndim)
        if is_quantized(x):
            return _place_quantized(layout, x, dims)
        return layout.constrain(x, *dims)

    return FusedLayer(**{f.name: place(f.name) for f in dataclasses.fields(p)})


def _place_quantized(layout: DecodeLayout, x: Any, dims: tuple) -> Any:
    """A ``QArray``'s values and scales on ``dims`` (a scale's size-1 axes whole)."""
    return jax.tree.map(
        lambda a: layout.constrain(a, *(d if n > 1 else None for d, n in zip(dims, a.shape))), x
    )


def place_model(layout: DecodeLayout, model: Transformer) -> Transformer:
    """The embedding (and untied or 8-bit head) whole along the width, rows over the vocabulary axis."""

    def head(x):
        if x is None:
            return None
        if is_quantized(x):
            return _place_quantized(layout, x, ("vocab", None))
        return layout.constrain(x, "vocab", None)

    return dataclasses.replace(model, embed=head(model.embed), lm_head=head(model.lm_head))


def attention_kernel(
    kind: str, layout: DecodeLayout, num_gen: int, scale: float | None, probs_dtype=None
):
    """``fn(q, pk, pv, prompt_allowed, own_k, own_v, own_allowed)`` of ``RolloutConfig.decode_attention``;
    on a mesh the Pallas kernel runs per shard (rows over the batch axes, KV heads over tensor).
    ``probs_dtype``: of the probabilities in ``P V`` (the XLA path; the kernel's are float32)."""
    if kind == "xla":
        return functools.partial(
            reference_decode_attention, num_gen=num_gen, scale=scale, probs_dtype=probs_dtype
        )
    if kind == "pallas" and not pallas_available(jax.default_backend()):
        raise ValueError(
            f"decode_attention='pallas' needs a CUDA GPU (backend: {jax.default_backend()}); "
            "use 'xla', or 'pallas_interpret' to run the kernel in Pallas' interpreter"
        )
    kernel = functools.partial(
        pallas_decode_attention, num_gen=num_gen, scale=scale, interpret=kind == "pallas_interpret"
    )
    if not layout.sharded:
        return kernel
    heads = layout.spec("batch", "heads")
    in_specs = (heads, heads, heads, layout.spec("batch"), heads, heads, layout.spec())
    return jax.shard_map(kernel, in_specs=in_specs, out_specs=heads, check_vma=False)


def decode_attend(
    model: Transformer,
    layout: DecodeLayout,
    kernel,
    num_gen: int,
    q_pos,
    prompt_pos,
    prompt_valid,
    t,
    seg: int,
    chunk: int,
):
    """Attention of one new token per completion over [shared prompt | own cache incl. itself].

    ``q`` arrives as ``[P*G, 1, Hq, D]`` and is grouped ``[P*G, Hkv, R, D]``; ``kernel``
    (``attention_kernel``) folds the G completions of a prompt into the query rows against the
    prompt's single copy of its keys ``[P, Hkv, D, Lp]``. The completion cache is a list of blocks
    of ``chunk`` slots; during segment ``seg`` (steps ``seg*chunk <= t < (seg+1)*chunk``) blocks
    before ``seg`` are full, block ``seg`` is being filled and later blocks are not read at all.
    Each layer masks by its own window (the decode loop runs the layers with static kinds).
    """
    c = model.config
    hk, r = c.num_kv_heads, c.q_per_kv

    def attend(q, k, v, layer_input, sliding):
        window = layer_window(c, sliding)
        pk, pv, ck, cv = layer_input
        b, _, hq, d = q.shape
        p = b // num_gen
        qg = layout.constrain(
            q.reshape(b, hk, r, d), "batch", "heads", None, None
        )  # rows of a KV head: its R heads
        k, v = (layout.constrain(x.reshape(b, hk, d), "batch", "heads", None) for x in (k, v))
        allowed_p = prompt_valid
        if window is not None:
            qpos_p = q_pos.reshape(p, num_gen)[:, 0]
            allowed_p = allowed_p & ((qpos_p[:, None] - prompt_pos) < window)
        # this step's key/value go into block seg first (in place, before it is read)
        ck, cv = list(ck), list(cv)
        ck[seg] = jax.lax.dynamic_update_index_in_dim(
            ck[seg], k.astype(ck[seg].dtype), t - seg * chunk, axis=3
        )
        cv[seg] = jax.lax.dynamic_update_index_in_dim(
            cv[seg], v.astype(cv[seg].dtype), t - seg * chunk, axis=2
        )
        ck, cv = (
            [layout.constrain(x, "batch", "heads", None, None) for x in xs] for xs in (ck, cv)
        )
        own_allowed = []
        for blk in range(seg + 1):
            slots = blk * chunk + jnp.arange(cv[blk].shape[2])
            allowed = slots <= t
            own_allowed.append(allowed if window is None else allowed & (t - slots < window))
        out = kernel(
            qg, pk, pv, allowed_p, tuple(ck[: seg + 1]), tuple(cv[: seg + 1]), tuple(own_allowed)
        )
        return out.reshape(b, 1, hq, d).astype(q.dtype), (tuple(ck), tuple(cv))

    return attend


class Rows(NamedTuple):
    """What the decode loops of one compaction phase read per row (``relax.rollout.compaction``):
    the rows' places in the ``[B, N]`` outputs (None: all rows, in order), their prompts' keys and
    values (``[P, ...]`` shared by ``num_gen`` rows each, or one copy per row once compacted),
    prompt positions and validity, first decode position, RoPE tables and uniform draws."""

    index: Int[Array, " b"] | None
    num_gen: int
    prompt_kv: list
    prompt_pos: Int[Array, "p lp"]
    prompt_valid: Bool[Array, "p lp"]
    q_pos_base: Int[Array, " b"]
    rope_table: Any
    u: Float[Array, "b n"]


def compact(
    rows: Rows, bufs, finished, ck, cv, size: int, g: int, layout: DecodeLayout, merge: int
):
    """The next phase's ``size`` rows (``keep_rows``): their output buffers and caches gathered
    (every ``merge`` consecutive cache blocks joined into one); prompts become per row."""
    keep = keep_rows(finished, size)
    index = keep if rows.index is None else rows.index[keep]
    by_row = lambda x: jnp.take(x, keep, axis=0)  # noqa: E731
    by_prompt = (lambda x: jnp.take(x, index // g, axis=0)) if rows.num_gen > 1 else by_row  # noqa: E731
    heads = lambda x: layout.constrain(x, "batch", "heads", None, None)  # noqa: E731
    join = (
        lambda blocks, axis: tuple(  # noqa: E731
            heads(by_row(jnp.concatenate(blocks[i : i + merge], axis=axis)))
            for i in range(0, len(blocks), merge)
        )
    )
    ck = [join(blocks, 3) for blocks in ck]  # keys [b, Hkv, D, slots]
    cv = [join(blocks, 2) for blocks in cv]  # values [b, Hkv, slots, D]
    kv = [(heads(by_prompt(k)), heads(by_prompt(v))) for k, v in rows.prompt_kv]
    row = lambda x: layout.constrain(x, "batch", *(None,) * (x.ndim - 1))  # noqa: E731
    nxt = Rows(
        index=row(index),
        num_gen=1,
        prompt_kv=kv,
        prompt_pos=row(by_prompt(rows.prompt_pos)),
        prompt_valid=row(by_prompt(rows.prompt_valid)),
        q_pos_base=row(by_row(rows.q_pos_base)),
        rope_table=jax.tree.map(lambda x: row(by_row(x)), rows.rope_table),
        u=row(by_row(rows.u)),
    )
    return nxt, tuple(row(by_row(x)) for x in bufs), row(by_row(finished)), ck, cv


def write_back(out, index, bufs):
    """A phase's output buffers (tokens, log-probs, mask, routes of its rows) into the ``[B, ...]``
    outputs ``out`` at rows ``index`` (None: every row, in order: the buffers are the outputs)."""
    if index is None:
        return bufs
    return tuple(o.at[index].set(b) for o, b in zip(out, bufs))
