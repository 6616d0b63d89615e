"""Block attention pieces (relax.models.attention.blocks) against a numpy softmax over the union of the blocks."""

import chex
import jax.numpy as jnp
import numpy as np

from relax.models.attention.blocks import (
    block_stats,
    merge_stats,
    partial_attention,
    shared_prefix_attention,
)

B, HK, M, D = 3, 2, 4, 8


def _numpy_softmax_attention(q, ks, vs, masks):
    k, v = np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)
    ok = np.concatenate([np.broadcast_to(a, (B, HK, M, a.shape[-1])) for a in masks], axis=-1)
    s = np.einsum("bhmd,bhsd->bhms", q, k) / np.sqrt(D)
    s = np.where(ok, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    return np.einsum("bhms,bhsd->bhmd", e / np.where(den > 0, den, 1.0), v), ok


def test_merged_blocks_equal_one_softmax_over_their_union():
    rng = np.random.default_rng(0)
    sizes = (5, 3, 4)
    q = rng.normal(size=(B, HK, M, D))
    ks = [rng.normal(size=(B, HK, s, D)) * 2 for s in sizes]
    vs = [rng.normal(size=(B, HK, s, D)) for s in sizes]
    masks = [rng.random((B, 1, M, s)) < 0.6 for s in sizes]
    masks[0][0, 0, 1] = False
    masks[1][0, 0, 1] = False
    masks[2][0, 0, 1] = False  # row (0, ., 1) sees no key at all: zeros
    masks[1][2] = False  # a block with nothing visible for batch row 2
    want, ok = _numpy_softmax_attention(q, ks, vs, masks)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    blocks = [block_stats(f32(q), f32(k), f32(v), jnp.asarray(a)) for k, v, a in zip(ks, vs, masks)]
    got = merge_stats(blocks)
    chex.assert_shape(got, (B, HK, M, D))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    assert np.all(np.asarray(got)[0, :, 1] == 0.0)
    # keys stored [b, hk, d, s] give the same statistics
    kt = block_stats(
        f32(q),
        f32(np.swapaxes(ks[0], -1, -2)),
        f32(vs[0]),
        jnp.asarray(masks[0]),
        k_transposed=True,
    )
    chex.assert_trees_all_close(kt, blocks[0], atol=1e-6)


def test_partial_attention_normalises_one_block_and_returns_its_logsumexp():
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.normal(size=(B, HK, M, D)),
        rng.normal(size=(B, HK, 6, D)),
        rng.normal(size=(B, HK, 6, D)),
    )
    mask = rng.random((B, 1, M, 6)) < 0.7
    mask[1, 0, 2] = False
    out, lse = partial_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(mask)
    )
    want, _ = _numpy_softmax_attention(q, [k], [v], [mask])
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    s = np.where(
        np.broadcast_to(mask, (B, HK, M, 6)),
        np.einsum("bhmd,bhsd->bhms", q, k) / np.sqrt(D),
        -np.inf,
    )
    with np.errstate(divide="ignore"):
        want_lse = np.log(np.sum(np.exp(s), axis=-1))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-5)
    assert np.all(np.asarray(lse)[~seen] < -1e29)  # nothing visible: about NEG_INF, never NaN


def test_shared_prefix_block_equals_the_prefix_copied_per_sequence():
    rng = np.random.default_rng(2)
    p, g, s = 2, 3, 5
    q = rng.normal(size=(p * g, HK, M, D))
    k, v = rng.normal(size=(p, HK, s, D)), rng.normal(size=(p, HK, s, D))
    allowed = rng.random((p, 1, g * M, s)) < 0.8
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = shared_prefix_attention(f32(q), f32(k), f32(v), jnp.asarray(allowed), g)
    per_seq = allowed.reshape(p, 1, g, M, s).transpose(0, 2, 1, 3, 4).reshape(p * g, 1, M, s)
    want = block_stats(
        f32(q), f32(np.repeat(k, g, 0)), f32(np.repeat(v, g, 0)), jnp.asarray(per_seq)
    )
    chex.assert_trees_all_close(got, want, atol=1e-5)
