"""Shared-prefix decode attention: the sampler's XLA path and an opt-in Pallas (Triton) kernel.

One decode step: each of ``B = P*G`` completions has one new query position with ``R = Hq/Hkv``
query heads per KV head. Completion ``b`` attends to its group's ONE prompt block (prompt
``p = b // G``) and to its own completion cache, a tuple of blocks; the result is the exact
softmax over the union of the visible keys, float32 (zeros for a row that sees no key).

Layout (as in ``relax.models.attention.blocks``): queries ``[B, Hkv, R, D]``; keys stored transposed,
prompt ``[P, Hkv, D, Lp]`` and own blocks ``[B, Hkv, D, S_i]``; values ``[.., S, D]``; masks
``prefix_allowed [P, Lp]`` (prompt padding and sliding window folded in) and ``own_allowed[i]
[S_i]`` (the same for every completion).

``reference_decode_attention`` is the XLA path: one ``shared_prefix_attention`` block plus one
``block_stats`` per own block, combined by ``merge_stats``. ``pallas_decode_attention`` computes
the same with an online (flash) softmax in float32 over key tiles ``z = q.k * scale``::

    m' = max(m, max_s z_s),   c = exp(m - m'),   p_s = exp(z_s - m')  (0 where masked)
    l' = c l + sum_s p_s,     u' = c u + sum_s p_s v_s,        o = u / l  (0 where l = 0)

which is the merge identity of ``attention.merge_stats`` applied one tile at a time.

Grid ``(P, Hkv, row tiles)``: the ``G*R`` query rows of a prompt and KV head are folded
(row ``g*R + r``) and split into tiles of ``block_rows`` rows (one tile unless ``G*R`` is
large), so the prompt's keys and values are read once per tile for all its completions. Each
program then walks the own blocks of the completions in its tile; a completion's keys are
scored against the whole row tile with the other completions' rows masked out (a dot needs
at least 16 rows: the extra products cost arithmetic, not cache reads).

Tiles are Triton-sized: rows padded to a power of two ``>= 16``, ``D`` to a power of two
``>= 16`` (zero columns do not change a dot product), ``Lp`` and each ``S_i`` to a multiple of
their key tile (``<= block_k``, masked out); padding copies an input only where its length
is not already a multiple (choose prompt buckets and the cache chunk accordingly).

The kernel is opt-in: the XLA path stays the default until the kernel is measured on a GPU.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from relax.models.attention.blocks import NEG_INF, block_stats, merge_stats, shared_prefix_attention

BLOCK_K = 64  # keys per tile
BLOCK_ROWS = 64  # folded query rows per program
MIN_DIM = 16  # Triton's dot wants every dimension >= 16

OwnKeys = Sequence[Float[Array, "b hk d _"]]
OwnValues = Sequence[Float[Array, "b hk _ d"]]
OwnAllowed = Sequence[Bool[Array, "_"]]  # noqa: F821 (a jaxtyping shape)


def reference_decode_attention(
    q: Float[Array, "b hk r d"],
    prefix_k: Float[Array, "p hk d lp"],
    prefix_v: Float[Array, "p hk lp d"],
    prefix_allowed: Bool[Array, "p lp"],
    own_k: OwnKeys,
    own_v: OwnValues,
    own_allowed: OwnAllowed,
    *,
    num_gen: int,
    scale: float | None = None,
    probs_dtype=None,
) -> Float[Array, "b hk r d"]:
    """The XLA path (module docstring); ``scale`` None means ``D^-1/2``; ``probs_dtype`` as in
    ``relax.models.attention.blocks.block_stats``."""
    blocks = [
        shared_prefix_attention(
            q,
            prefix_k,
            prefix_v,
            prefix_allowed[:, None, None, :],
            num_gen,
            k_transposed=True,
            scale=scale,
            probs_dtype=probs_dtype,
        )
    ]
    for k, v, allowed in zip(own_k, own_v, own_allowed, strict=True):
        blocks.append(
            block_stats(
                q,
                k,
                v,
                allowed[None, None, None, :],
                k_transposed=True,
                scale=scale,
                probs_dtype=probs_dtype,
            )
        )
    return merge_stats(blocks)


def pallas_available(backend: str) -> bool:
    """Whether the compiled kernel can run on ``backend``: "gpu"/"cuda" with a CUDA GPU present and
    Pallas' Triton lowering importable (jaxlib with the CUDA plugin). TPU (Mosaic) and ROCm are not
    targeted yet; anywhere else the kernel runs only with ``interpret=True``."""
    if backend not in ("gpu", "cuda"):
        return False
    try:
        importlib.import_module("jax.experimental.pallas.triton")  # the Triton lowering
        device = jax.devices(backend)[0]
    except (ImportError, RuntimeError, IndexError):
        return False
    return (
        device.platform == "gpu"
        and "rocm" not in str(getattr(device.client, "platform_version", "")).lower()
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _key_tile(n: int, block_k: int) -> int:
    return min(max(MIN_DIM, _pow2(block_k)), max(MIN_DIM, _pow2(n)))


def _pad_to(x: Array, axis: int, size: int) -> Array:
    """Zero-pad (False for masks) ``axis`` at the end to ``size``; no copy when it already fits."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _scan_keys(q, load_k, load_v, load_ok, num_tiles: int, tile: int, scale: float, state):
    """Online softmax of the row tile ``q [M, D]`` over ``num_tiles`` key tiles of ``tile`` keys;
    ``load_k(sl) [D, T]``, ``load_v(sl) [T, D]``, ``load_ok(sl)`` a mask broadcasting to ``[M, T]``."""
    from jax.experimental import pallas as pl

    def body(i, state):
        acc, m, l = state
        sl = pl.ds(pl.multiple_of(i * tile, tile), tile)
        k, v, ok = load_k(sl), load_v(sl), load_ok(sl)
        dt = jnp.promote_types(q.dtype, k.dtype)
        z = (
            jnp.dot(
                q.astype(dt),
                k.astype(dt),
                precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        z = jnp.where(ok, z, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        c = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(z - m_new[:, None]), 0.0)
        pv = jnp.dot(
            p.astype(v.dtype),
            v,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return c[:, None] * acc + pv, m_new, c * l + jnp.sum(p, axis=1)

    return lax.fori_loop(0, num_tiles, body, state)


def _kernel(
    q_ref,
    pk_ref,
    pv_ref,
    pa_ref,
    *refs,
    num_own: int,
    num_gen: int,
    rows_per_gen: int,
    block_rows: int,
    tiles: tuple[int, ...],
    scale: float,
):
    """One (prompt, KV head, row tile): the prompt's tiles once, then each completion's own blocks."""
    from jax.experimental import pallas as pl

    ok_refs, o_ref = refs[2 * num_own : 3 * num_own], refs[-1]
    q = q_ref[...]
    row0 = pl.program_id(2) * block_rows
    gen_of_row = (row0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)) // rows_per_gen
    state = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_rows,), NEG_INF, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )
    state = _scan_keys(
        q,
        lambda sl: pk_ref[:, sl],
        lambda sl: pv_ref[sl, :],
        lambda sl: (pa_ref[sl] != 0)[None, :],
        pa_ref.shape[0] // tiles[0],
        tiles[0],
        scale,
        state,
    )

    def completion(g, state):
        row_ok = (gen_of_row == g)[:, None]
        for j in range(num_own):
            k_ref, v_ref, ok_ref, tile = refs[j], refs[num_own + j], ok_refs[j], tiles[1 + j]
            state = _scan_keys(
                q,
                lambda sl, k_ref=k_ref: k_ref[g, :, sl],
                lambda sl, v_ref=v_ref: v_ref[g, sl, :],
                lambda sl, ok_ref=ok_ref: row_ok & (ok_ref[sl] != 0)[None, :],
                ok_ref.shape[0] // tile,
                tile,
                scale,
                state,
            )
        return state

    g_lo = row0 // rows_per_gen
    g_hi = jnp.minimum(num_gen, (row0 + block_rows + rows_per_gen - 1) // rows_per_gen)
    acc, _, l = lax.fori_loop(g_lo, g_hi, completion, state)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]


def pallas_decode_attention(
    q: Float[Array, "b hk r d"],
    prefix_k: Float[Array, "p hk d lp"],
    prefix_v: Float[Array, "p hk lp d"],
    prefix_allowed: Bool[Array, "p lp"],
    own_k: OwnKeys,
    own_v: OwnValues,
    own_allowed: OwnAllowed,
    *,
    num_gen: int,
    scale: float | None = None,
    interpret: bool = False,
    block_k: int = BLOCK_K,
    block_rows: int = BLOCK_ROWS,
) -> Float[Array, "b hk r d"]:
    """``reference_decode_attention`` as one Pallas kernel (module docstring). ``interpret``: run
    with Pallas' interpreter (any backend); ``block_k``/``block_rows``: the largest key and row
    tiles (rounded to powers of two)."""
    from jax.experimental import pallas as pl

    b, hk, r, d = q.shape
    p, g = prefix_k.shape[0], num_gen
    scale = d**-0.5 if scale is None else scale
    dp, rows = max(MIN_DIM, _pow2(d)), g * r
    bm = min(max(MIN_DIM, _pow2(block_rows)), max(MIN_DIM, _pow2(rows)))
    mp = _round_up(rows, bm)
    tiles = tuple(_key_tile(x.shape[-1], block_k) for x in (prefix_k, *own_k))
    lens = [_round_up(x.shape[-1], t) for x, t in zip((prefix_k, *own_k), tiles)]

    qf = q.reshape(p, g, hk, r, d).transpose(0, 2, 1, 3, 4).reshape(p, hk, rows, d)
    qf = _pad_to(_pad_to(qf, 2, mp), 3, dp)
    pk = _pad_to(_pad_to(prefix_k, 2, dp), 3, lens[0])
    pv = _pad_to(_pad_to(prefix_v, 2, lens[0]), 3, dp)
    pa = _pad_to(prefix_allowed.astype(jnp.int32), 1, lens[0])
    ok = [_pad_to(a.astype(jnp.int32), 0, n) for a, n in zip(own_allowed, lens[1:], strict=True)]
    ks = [
        _pad_to(_pad_to(k, 2, dp), 3, n).reshape(p, g, hk, dp, n)
        for k, n in zip(own_k, lens[1:], strict=True)
    ]
    vs = [
        _pad_to(_pad_to(v, 2, n), 3, dp).reshape(p, g, hk, n, dp)
        for v, n in zip(own_v, lens[1:], strict=True)
    ]

    at_head = lambda shape: pl.BlockSpec((None, None) + shape, lambda i, h, t: (i, h, 0, 0))
    per_gen = lambda shape: pl.BlockSpec((None, g, None) + shape, lambda i, h, t: (i, 0, h, 0, 0))
    in_specs = [
        pl.BlockSpec((None, None, bm, dp), lambda i, h, t: (i, h, t, 0)),
        at_head((dp, lens[0])),
        at_head((lens[0], dp)),
        pl.BlockSpec((None, lens[0]), lambda i, h, t: (i, 0)),
    ]
    in_specs += [per_gen((dp, n)) for n in lens[1:]] + [per_gen((n, dp)) for n in lens[1:]]
    in_specs += [pl.BlockSpec((n,), lambda i, h, t: (0,)) for n in lens[1:]]
    kernel = functools.partial(
        _kernel,
        num_own=len(ks),
        num_gen=g,
        rows_per_gen=r,
        block_rows=bm,
        tiles=tiles,
        scale=float(scale),
    )
    out = pl.pallas_call(
        kernel,
        grid=(p, hk, mp // bm),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bm, dp), lambda i, h, t: (i, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((p, hk, mp, dp), jnp.float32),
        compiler_params=None if interpret else _triton_params(),
        interpret=interpret,
        name="shared_prefix_decode_attention",
    )(qf, pk, pv, pa, *ks, *vs, *ok)
    out = out[:, :, :rows, :d].reshape(p, hk, g, r, d)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, hk, r, d)


def _triton_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)
