"""Shared-prefix decode attention (relax.models.attention.decode): the XLA path and the Pallas kernel
(run by Pallas' interpreter) against a numpy softmax over [the group's prompt keys; the row's own keys]."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models.attention.decode import (
    pallas_available,
    pallas_decode_attention,
    reference_decode_attention,
)

STATIC = ("num_gen", "scale", "interpret", "block_k", "block_rows")
XLA = jax.jit(reference_decode_attention, static_argnames=STATIC[:2])
PALLAS = jax.jit(functools.partial(pallas_decode_attention, interpret=True), static_argnames=STATIC)

# (P, G, Hkv, R, D, Lp, own block sizes, scale, kernel tiles)
CASES = {
    "ragged": (2, 3, 2, 2, 8, 13, (8, 5), 0.3, {}),
    "g1_r1": (1, 1, 1, 1, 16, 16, (16,), None, {}),
    "three_blocks": (3, 2, 1, 4, 16, 40, (16, 16, 3), None, {"block_k": 16}),
    "row_tiles": (
        2,
        7,
        1,
        3,
        8,
        70,
        (32, 7),
        0.5,
        {"block_k": 16, "block_rows": 16},
    ),  # tiles split completions
}


def _numpy_attention(q, pk, pv, pa, ok, ov, oa, g, scale):
    """Per row: softmax (float64) over the visible keys of concat(prompt of b // g, own blocks of b)."""
    q, pk, pv = (np.asarray(x, np.float64) for x in (q, pk, pv))
    ok, ov = [np.asarray(x, np.float64) for x in ok], [np.asarray(x, np.float64) for x in ov]
    b, _, _, d = q.shape
    scale = d**-0.5 if scale is None else scale
    out = np.zeros(q.shape)
    for i in range(b):
        k = np.concatenate([pk[i // g]] + [x[i] for x in ok], axis=-1)  # [hk, d, s]
        v = np.concatenate([pv[i // g]] + [x[i] for x in ov], axis=-2)  # [hk, s, d]
        visible = np.concatenate([np.asarray(pa[i // g])] + [np.asarray(a) for a in oa])
        if not visible.any():
            continue
        z = np.einsum("hrd,hds->hrs", q[i], k[..., visible]) * scale
        w = np.exp(z - z.max(-1, keepdims=True))
        out[i] = np.einsum("hrs,hsd->hrd", w / w.sum(-1, keepdims=True), v[:, visible])
    return out


def _masks(p, lp, sizes, kind):
    """Left-padded prompts (prompt i has ``2i`` pad slots), completion slots ``<= t`` with ``t`` inside
    the second-to-last block; "window": only the last 6 positions (prompt end + own slots) are visible;
    "empty": the last prompt and every own slot are masked (its rows see nothing)."""
    pa = np.arange(lp)[None, :] >= 2 * np.arange(p)[:, None]
    slots = np.arange(sum(sizes))
    t = max(sum(sizes[:-1]) - 2, 1)
    own = slots <= t
    if kind == "window":
        pos = np.concatenate(
            [np.arange(lp), lp + slots]
        )  # one position line: prompt then completion
        now = lp + t
        pa = pa & (now - pos[None, :lp] < 6)
        own = own & (now - pos[lp:] < 6)
    if kind == "empty":
        pa[-1] = False
        own[:] = False
    return jnp.asarray(pa), tuple(jnp.asarray(a) for a in np.split(own, np.cumsum(sizes)[:-1]))


def _inputs(case, kind, dtype, seed=0):
    p, g, hk, r, d, lp, sizes, scale, tiles = CASES[case]
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) * 1.5, dtype)
    q, pk, pv = f(p * g, hk, r, d), f(p, hk, d, lp), f(p, hk, lp, d)
    ok = tuple(f(p * g, hk, d, s) for s in sizes)
    ov = tuple(f(p * g, hk, s, d) for s in sizes)
    pa, oa = _masks(p, lp, sizes, kind)
    return (q, pk, pv, pa, ok, ov, oa), dict(num_gen=g, scale=scale), tiles


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("kind", ["causal", "window", "empty"])
@pytest.mark.parametrize("case", list(CASES))
def test_both_paths_match_a_numpy_softmax_over_prompt_and_own_keys(case, kind, dtype, atol):
    args, kw, tiles = _inputs(case, kind, dtype)
    want = _numpy_attention(*args, kw["num_gen"], kw["scale"])
    for got in (XLA(*args, **kw), PALLAS(*args, **kw, **tiles)):
        chex.assert_shape(got, args[0].shape)
        chex.assert_type(got, jnp.float32)
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=atol)
        if kind == "empty":  # the last prompt's rows see no key: zeros, never NaN
            assert np.all(np.asarray(got)[-kw["num_gen"] :] == 0.0)


def test_pallas_is_not_available_without_a_gpu():
    assert not pallas_available("cpu")
    assert not pallas_available("tpu")
    assert pallas_available("gpu") == any(d.platform == "gpu" for d in jax.devices())


def test_kernel_lowers_to_triton():
    """Lowering for CUDA on a CPU host: Pallas' Triton lowering (power-of-two tiles, dot shapes,
    loops) runs without a GPU; Triton's own compile to PTX does not."""
    args, kw, tiles = _inputs("row_tiles", "causal", jnp.bfloat16)
    fn = jax.jit(functools.partial(pallas_decode_attention, **kw, **tiles))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
