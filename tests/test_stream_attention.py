"""stream_attention against a dense masked softmax over the full ``S x S`` allowed matrix (built
with numpy from its definition), its custom backward against autodiff of that reference, and
block_pairs against a brute-force block reduction of the same matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models.attention.stream import (
    StreamMask,
    allowed_mask,
    block_pairs,
    num_block_pairs,
    stream_attention,
)

HQ, HK, D = 4, 2, 8


def _stream(rng, s, prompts=3, max_completions=3, max_prompt=9, max_completion=12, pad=5):
    """numpy ``(positions, docs, prefix_of, is_prefix)``: prompts each followed by its completions
    (random lengths), then at least ``pad`` slots of padding."""
    pos, docs, pre, isp = (*(np.zeros(s, np.int32) for _ in range(3)), np.zeros(s, bool))
    at, doc = 0, 1
    for _ in range(prompts):
        lp = int(rng.integers(1, max_prompt + 1))
        lens = rng.integers(1, max_completion + 1, size=int(rng.integers(1, max_completions + 1)))
        if at + lp + lens.sum() > s - pad:
            break
        prompt = doc
        at, doc = _put(pos, docs, pre, isp, at, lp, doc, prompt, True, 0), doc + 1
        for n in lens:
            at, doc = _put(pos, docs, pre, isp, at, int(n), doc, prompt, False, lp), doc + 1
    return pos, docs, pre, isp


def _put(pos, docs, pre, isp, at, n, doc, prompt, is_prompt, start):
    pos[at : at + n] = start + np.arange(n)
    docs[at : at + n], pre[at : at + n], isp[at : at + n] = doc, prompt, is_prompt
    return at + n


def _allowed(pos, docs, pre, isp, window=None):
    """The ``[S, S]`` allowed matrix, straight from its definition."""
    qi = lambda x: x[:, None]
    kj = lambda x: x[None, :]
    ok = (qi(docs) > 0) & (kj(docs) > 0) & (kj(pos) <= qi(pos))
    if window is not None:
        ok &= qi(pos) - kj(pos) < window
    return ok & ((kj(docs) == qi(docs)) | (kj(isp) & (kj(pre) == qi(pre))))


def _dense(q, k, v, allowed):
    """Masked softmax over all ``S`` keys (GQA: query head h uses KV head h // R), float32."""
    r = q.shape[1] // k.shape[1]
    kk, vv = (jnp.repeat(x.astype(jnp.float32), r, axis=1) for x in (k, v))
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kk) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(allowed[None], s, -1e30), axis=-1)
    p = jnp.where(allowed[None].any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("hqk,khd->qhd", p, vv)


def _qkv(rng, s, dtype=jnp.float32):
    f = lambda h: jnp.asarray(rng.normal(size=(s, h, D)), jnp.float32).astype(dtype)
    return f(HQ), f(HK), f(HK)


def _grads(fn, q, k, v, w):
    return jax.grad(lambda *x: jnp.sum(fn(*x) * w), argnums=(0, 1, 2))(q, k, v)


def _close(got, want, rtol):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), want, rtol=rtol, atol=rtol * np.abs(want).max()
    )


def _check(meta, block, window, seed, dtype=jnp.float32, probs_dtype=None, tol=(1e-5, 1e-4)):
    rng = np.random.default_rng(seed)
    s = meta[0].shape[0]
    q, k, v = _qkv(rng, s, dtype)
    w = jnp.asarray(rng.normal(size=(s, HQ, D)), jnp.float32)
    pairs, n = block_pairs(*meta[1:], block)
    mask = StreamMask(*map(jnp.asarray, meta))
    fn = lambda q, k, v: stream_attention(
        q, k, v, mask, pairs, n, block=block, window=window, probs_dtype=probs_dtype
    )
    ref = lambda q, k, v: _dense(q, k, v, jnp.asarray(_allowed(*meta, window)))
    out = fn(q, k, v)
    assert out.dtype == jnp.float32 and out.shape == (s, HQ, D)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(q, k, v)), atol=tol[0])
    for got, want, x in zip(_grads(fn, q, k, v, w), _grads(ref, q, k, v, w), (q, k, v)):
        assert got.dtype == x.dtype
        _close(got, want, tol[1])


@pytest.mark.parametrize(
    "s,block,window,seed",
    [(64, 8, None, 0), (128, 16, None, 1), (96, 8, 5, 2), (128, 16, 7, 3), (128, 8, None, 4)],
)
@pytest.mark.slow
def test_matches_dense_reference(s, block, window, seed):
    _check(_stream(np.random.default_rng(seed + 10), s, prompts=4), block, window, seed)


def test_traced_window_matches_static():
    meta = _stream(np.random.default_rng(5), 64)
    q, k, v = _qkv(np.random.default_rng(6), 64)
    pairs, n = block_pairs(*meta[1:], 8)
    mask = StreamMask(*map(jnp.asarray, meta))
    traced = jax.jit(lambda w: stream_attention(q, k, v, mask, pairs, n, block=8, window=w))
    ref = _dense(q, k, v, jnp.asarray(_allowed(*meta, 4)))
    np.testing.assert_allclose(np.asarray(traced(jnp.int32(4))), np.asarray(ref), atol=1e-5)


def test_bfloat16_probabilities():
    # bfloat16 inputs, P rounded to bfloat16 in P V: the reference runs in float32 on the same
    # (rounded) inputs; the backward recomputes in float32, so gradients stay close.
    meta = _stream(np.random.default_rng(7), 96, prompts=4)
    _check(meta, 16, None, 8, dtype=jnp.bfloat16, probs_dtype=jnp.bfloat16, tol=(1e-2, 2e-2))


def test_fully_padded_stream_gives_zeros():
    s = 32
    zeros = np.zeros(s, np.int32)
    meta = (zeros, zeros, zeros, np.zeros(s, bool))
    pairs, n = block_pairs(*meta[1:], 8)
    assert n == 0 and pairs.shape == (num_block_pairs(s, 8), 2) and not pairs.any()
    q, k, v = _qkv(np.random.default_rng(9), s)
    fn = lambda q, k, v: stream_attention(q, k, v, StreamMask(*meta), pairs, n, block=8)
    assert not np.asarray(fn(q, k, v)).any()
    for g in _grads(fn, q, k, v, jnp.ones((s, HQ, D))):
        assert np.isfinite(np.asarray(g)).all() and not np.asarray(g).any()


def _brute_pairs(meta, block):
    """The block pairs with any allowed entry (no window), from the full matrix."""
    allowed = _allowed(*meta)
    nb = allowed.shape[0] // block
    per_block = allowed.reshape(nb, block, nb, block).any(axis=(1, 3))
    return np.argwhere(per_block)  # row-major: sorted by query block, then key block


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block", [1, 4, 8, 16])
def test_block_pairs_exact(seed, block):
    rng = np.random.default_rng(100 + seed)
    meta = _stream(rng, 128, prompts=5, max_completions=4, max_prompt=20, max_completion=25)
    pairs, n = block_pairs(*meta[1:], block)
    want = _brute_pairs(meta, block)
    assert n == len(want) > 0
    np.testing.assert_array_equal(pairs[:n], want)
    assert pairs.shape == (num_block_pairs(128, block), 2) and pairs.dtype == np.int32
    np.testing.assert_array_equal(pairs[n:], np.broadcast_to(want[-1], pairs[n:].shape))


def test_block_pairs_exact_on_many_short_documents():
    meta = _stream(np.random.default_rng(11), 1024, prompts=200, max_prompt=6, max_completion=8)
    for block in (8, 32):
        pairs, n = block_pairs(*meta[1:], block)
        np.testing.assert_array_equal(pairs[:n], _brute_pairs(meta, block))


def test_allowed_mask_is_the_definition():
    # the dense mask of the fused per-bin kernel, one stream and a batch of two
    rng = np.random.default_rng(21)
    metas = [_stream(rng, 48, prompts=4), _stream(rng, 48, prompts=2, max_completions=1)]
    for meta in metas:
        got = allowed_mask(StreamMask(*map(jnp.asarray, meta)))
        np.testing.assert_array_equal(np.asarray(got), _allowed(*meta))
    batched = allowed_mask(StreamMask(*(jnp.asarray(np.stack(x)) for x in zip(*metas))))
    np.testing.assert_array_equal(np.asarray(batched), np.stack([_allowed(*m) for m in metas]))


def test_loop_visits_only_the_real_pairs():
    # Many short documents: far fewer pairs than every causal pair. The padded tail is filled with
    # copies of real pairs that hold allowed entries: visiting any of them again would count its
    # keys twice, so the output is right only if the loop stops at num_pairs.
    rng = np.random.default_rng(12)
    s, block = 256, 8
    meta = _stream(rng, s, prompts=40, max_completions=2, max_prompt=4, max_completion=5)
    pairs, n = block_pairs(*meta[1:], block)
    assert n < num_block_pairs(s, block) // 4
    garbage = pairs.copy()
    garbage[n:] = pairs[rng.integers(0, n, size=len(pairs) - n)]
    q, k, v = _qkv(rng, s)
    mask = StreamMask(*map(jnp.asarray, meta))
    ref = np.asarray(_dense(q, k, v, jnp.asarray(_allowed(*meta))))
    run = lambda count: np.asarray(stream_attention(q, k, v, mask, garbage, count, block=block))
    np.testing.assert_allclose(run(n), ref, atol=1e-5)
    assert np.abs(run(len(garbage)) - ref).max() > 1e-2  # the tail would change the result


def test_vmap_over_streams_with_different_pair_counts():
    rng = np.random.default_rng(13)
    s, block = 64, 8
    metas = [_stream(rng, s, prompts=1), _stream(rng, s, prompts=4, max_completion=6)]
    listed = [block_pairs(*m[1:], block) for m in metas]
    assert listed[0][1] != listed[1][1]
    pairs = jnp.asarray(np.stack([p for p, _ in listed]))
    counts = jnp.asarray([c for _, c in listed])
    mask = StreamMask(*(jnp.asarray(np.stack(x)) for x in zip(*metas)))
    qkv = [_qkv(rng, s) for _ in metas]
    q, k, v = (jnp.stack(x) for x in zip(*qkv))
    w = jnp.asarray(rng.normal(size=(2, s, HQ, D)), jnp.float32)
    batched = jax.vmap(lambda *a: stream_attention(*a, block=block))
    fn = lambda q, k, v: batched(q, k, v, mask, pairs, counts)
    grads = _grads(fn, q, k, v, w)
    out = fn(q, k, v)
    for b, meta in enumerate(metas):
        ref = lambda q, k, v, meta=meta: _dense(q, k, v, jnp.asarray(_allowed(*meta)))
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(ref(*qkv[b])), atol=1e-5)
        for got, want in zip(grads, _grads(ref, *qkv[b], w[b])):
            _close(got[b], want, 1e-4)


def test_errors_name_the_field():
    meta = _stream(np.random.default_rng(14), 64)
    q, k, v = _qkv(np.random.default_rng(15), 64)
    pairs, n = block_pairs(*meta[1:], 8)
    with pytest.raises(ValueError, match="block=12"):
        block_pairs(*meta[1:], 12)
    with pytest.raises(ValueError, match="block=12"):
        num_block_pairs(64, 12)
    with pytest.raises(ValueError, match="prefix_of"):
        block_pairs(meta[1], meta[2][:32], meta[3], 8)
    bad = StreamMask(*meta)._replace(docs=jnp.zeros(32, jnp.int32))
    with pytest.raises(ValueError, match="mask.docs"):
        stream_attention(q, k, v, bad, pairs, n, block=8)
    with pytest.raises(ValueError, match="pairs"):
        stream_attention(q, k, v, StreamMask(*meta), pairs[:, :1], n, block=8)
    assert num_block_pairs(64, 8) == 36


@pytest.mark.slow
def test_nested_vmap_with_a_window_per_stream_and_shared_keys():
    # [2, 2] streams, a traced window per stream, k and v shared along the inner axis (in_axes
    # None): each inner batch runs as one stream of 2 S slots, the outer batch flattens again.
    rng = np.random.default_rng(16)
    s, block, windows = 64, 8, [3, 100, 6, 9]
    metas = [_stream(rng, s, prompts=int(rng.integers(1, 5))) for _ in range(4)]
    listed = [block_pairs(*m[1:], block) for m in metas]
    grid = lambda xs: jnp.asarray(np.stack(xs).reshape((2, 2) + np.shape(xs[0])))
    mask = StreamMask(*(grid(x) for x in zip(*metas)))
    pairs, counts = grid([p for p, _ in listed]), grid([c for _, c in listed])
    q = jnp.asarray(rng.normal(size=(2, 2, s, HQ, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, s, HK, D)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    att = lambda q, k, v, m, p, c, win: stream_attention(q, k, v, m, p, c, block=block, window=win)
    inner = jax.vmap(att, in_axes=(0, None, None, 0, 0, 0, 0))
    fn = lambda q, k, v: jax.vmap(inner)(q, k, v, mask, pairs, counts, grid(windows))
    out, (gq, gk, gv) = fn(q, k, v), _grads(fn, q, k, v, w)
    for a in range(2):
        want_k, want_v = 0.0, 0.0
        for b in range(2):
            allowed = jnp.asarray(_allowed(*metas[2 * a + b], windows[2 * a + b]))
            ref = lambda q, k, v, allowed=allowed: _dense(q, k, v, allowed)
            np.testing.assert_allclose(out[a, b], ref(q[a, b], k[a], v[a]), atol=1e-5)
            rq, rk, rv = _grads(ref, q[a, b], k[a], v[a], w[a, b])
            _close(gq[a, b], rq, 1e-4)
            want_k, want_v = want_k + rk, want_v + rv  # shared keys: the inner streams' sum
        _close(gk[a], want_k, 1e-4)
        _close(gv[a], want_v, 1e-4)
