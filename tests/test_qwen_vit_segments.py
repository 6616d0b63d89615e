"""The Qwen2.5-VL tower's attention inside segments (windows, frames) as a padded batch
(``relax.models.vision.qwen_vit.segments`` / ``segment_attention``) against dense attention under
the block-diagonal mask, computed in numpy."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from relax.models.vision.qwen_vit import segment_attention, segments


def test_segments_pad_each_segment_in_order():
    ids = np.array([2, 0, 2, 1, 0, 2])
    seg = segments(ids)
    assert seg.index.tolist() == [[1, 4, 0], [3, 0, 0], [0, 2, 5]]
    assert seg.valid.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    flat = seg.index.reshape(-1)
    assert flat[seg.back].tolist() == list(range(len(ids)))  # every patch back in its place


def _dense(q, k, v, ids):
    """softmax(q k^T / sqrt(d)) v over the keys of the query's own segment, per head (numpy)."""
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where((ids[:, None] == ids[None, :])[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("sizes", [(5,), (4, 7, 1), (3, 3, 9, 2)])
def test_segment_attention_is_dense_attention_under_the_block_mask(sizes):
    rng = np.random.default_rng(len(sizes))
    ids = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))  # segments interleaved
    q, k, v = (rng.standard_normal((len(ids), 2, 8)).astype(np.float32) for _ in range(3))
    got = jax.jit(lambda q, k, v: segment_attention(q, k, v, segments(ids)))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), _dense(q, k, v, ids), rtol=1e-5, atol=1e-5)
