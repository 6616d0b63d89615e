"""Packed rows as streams (``relax.models.forward.stream_rows``): the device's block pairs of rows
of whole examples against the full ``[T, T]`` mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models.attention.stream import num_block_pairs
from relax.models.forward.packed import segment_positions
from relax.models.forward.stream_rows import segment_pairs


def _row(rng, t, max_len, pad):
    """Segment ids of one row: examples of 1..max_len tokens, then ``pad`` padding slots at most."""
    seg, at, doc = np.zeros(t, np.int32), 0, 1
    while at < t - pad:
        n = min(int(rng.integers(1, max_len + 1)), t - pad - at)
        seg[at : at + n], at, doc = doc, at + n, doc + 1
    return seg


def _brute(seg, block):
    """Block pairs with an allowed entry (same example, causal), from the full matrix."""
    i, j = np.arange(len(seg))[:, None], np.arange(len(seg))[None, :]
    allowed = (seg[:, None] == seg[None, :]) & (seg[:, None] > 0) & (j <= i)
    nb = len(seg) // block
    return np.argwhere(allowed.reshape(nb, block, nb, block).any(axis=(1, 3)))


@pytest.mark.parametrize("block", [1, 4, 8, 16])
def test_segment_pairs_are_exactly_the_blocks_with_a_visible_key(block):
    rng = np.random.default_rng(block)
    rows = [_row(rng, 64, max_len, pad) for max_len in (3, 9, 40) for pad in (0, 7, 30)]
    rows += [
        np.zeros(64, np.int32),
        np.ones(64, np.int32),
    ]  # all padding; one example filling the row
    seg = jnp.asarray(np.stack(rows))
    pairs, counts = jax.jit(jax.vmap(lambda s, p: segment_pairs(s, p, block)))(
        seg, segment_positions(seg)
    )
    assert pairs.shape == (len(rows), num_block_pairs(64, block), 2)
    for seg, got, n in zip(rows, np.asarray(pairs), np.asarray(counts)):
        want = _brute(seg, block)
        assert n == len(want)
        np.testing.assert_array_equal(got[:n], want)
        # the tail is never visited but stays a valid causal block pair
        nb = 64 // block
        assert ((got[n:] >= 0) & (got[n:] < nb)).all() and (got[n:, 1] <= got[n:, 0]).all()
