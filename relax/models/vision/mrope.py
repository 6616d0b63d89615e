"""Qwen2.5-VL's multimodal RoPE (M-RoPE): three position ids per token and the sectioned tables.

Every token has a (t, h, w) position. A text token's three are equal, its index among the row's
valid tokens counted on from the last image (``get_rope_index``). An image of ``(T, H, W)``
patches (``(T, H/m, W/m)`` tokens after the ``m x m`` patch merger) starting at ``p`` gives its
tokens ``(p + t, p + h, p + w)`` in raster order, and the text after it continues at
``p + max(H, W)/m`` (for a single frame, ``T = 1``: the image's largest position + 1)::

    text "a b" | image 1x4x6 patches, m = 2 (2 x 3 tokens) | text "c"
    t: 0 1   2 2 2 2 2 2   5        h: 0 1   2 2 2 3 3 3   5        w: 0 1   2 3 4 2 3 4   5

The rotation tables split the ``head_dim/2`` frequencies into ``mrope_section = (s_t, s_h, s_w)``
consecutive sections; frequency ``j`` of section ``i`` rotates by position row ``i % 3``::

    angle[b, s, j] = pos[axis(j), b, s] * inv_freq[j],    axis = [0]*s_t + [1]*s_h + [2]*s_w
    cos, sin = cos([angle, angle]), sin([angle, angle])     (rotate-half layout, head_dim wide)

With three equal rows this is exactly ``relax.models.layers.rope.rotary``'s 1-D table (the same
float32 products), so text-only rows rotate as the plain language model does. The position ids
are computed on the host (numpy: they depend on where the image tokens are), as transformers does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from relax.models.config.model import ModelConfig
from relax.models.layers.rope import CosSin, Rotary, attention_factor, inverse_frequencies

__all__ = ["get_rope_index", "image_spans", "mrope_rotary", "sectioned_angles"]

Grid = tuple[tuple[int, int, int], ...]


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each run of True in a 1-D bool array."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def image_spans(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None,
    image_token_id: int,
    image_grid_thw: Grid,
    spatial_merge_size: int,
) -> list[list[tuple[int, int, int]]]:
    """Per row, its images as ``(start, stop, image index)`` over the row's valid tokens.

    Each run of ``image_token_id`` among a row's valid tokens is one image (the prompt brackets
    each with ``<|vision_start|>`` / ``<|vision_end|>``), taking the next ``image_grid_thw`` entry
    in row order (row 0's images first), as transformers assigns them. Raises ``ValueError`` naming
    the row and image when a run's length is not its grid's ``t*h*w / m^2`` tokens, and when the
    rows hold fewer or more images than ``image_grid_thw`` lists.
    """
    m2 = spatial_merge_size**2
    out, k = [], 0
    for r, row in enumerate(np.asarray(input_ids)):
        valid = row if attention_mask is None else row[np.asarray(attention_mask)[r].astype(bool)]
        spans = []
        for start, stop in _runs(valid == image_token_id):
            if k >= len(image_grid_thw):
                raise ValueError(
                    f"row {r}: image token run {start}:{stop} is image {k}, but image_grid_thw "
                    f"lists {len(image_grid_thw)} image(s)"
                )
            t, h, w = image_grid_thw[k]
            if stop - start != t * h * w // m2:
                raise ValueError(
                    f"row {r}: image {k} has {stop - start} image tokens ({image_token_id}), but "
                    f"its grid (t, h, w) = {(t, h, w)} gives {t * h * w // m2} features "
                    f"(t*h*w / {spatial_merge_size}^2)"
                )
            spans.append((start, stop, k))
            k += 1
        out.append(spans)
    if k != len(image_grid_thw):
        raise ValueError(
            f"the rows hold {k} image(s) (runs of image token {image_token_id}), but "
            f"image_grid_thw lists {len(image_grid_thw)}"
        )
    return out


def get_rope_index(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None,
    image_token_id: int,
    image_grid_thw: Grid,
    spatial_merge_size: int,
) -> tuple[Int[np.ndarray, "3 b t"], Int[np.ndarray, " b"]]:
    """The (t, h, w) positions ``[3, b, t]`` of every token (module docstring) and each row's
    ``rope_delta = max position + 1 - valid length`` (a token appended at index ``i`` of the valid
    tokens has position ``i + delta`` on all three rows), as transformers'
    ``Qwen2_5_VLModel.get_rope_index`` for images (the spans of ``image_spans``, which raises for a
    mismatched image). Padding (``attention_mask`` 0) gets position 0."""
    ids = np.asarray(input_ids)
    b, t = ids.shape
    m = spatial_merge_size
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    spans = image_spans(ids, mask, image_token_id, image_grid_thw, m)
    positions = np.zeros((3, b, t), np.int64)
    deltas = np.zeros(b, np.int64)
    for r in range(b):
        n = int(mask[r].sum())
        pos = np.zeros((3, n), np.int64)
        cur, at = 0, 0  # the next position, the next token
        for start, stop, k in spans[r] + [(n, n, None)]:
            pos[:, at:start] = cur + np.arange(start - at)
            cur += start - at
            if k is not None:
                gt, gh, gw = image_grid_thw[k]
                tt, hh, ww = np.meshgrid(
                    np.arange(gt), np.arange(gh // m), np.arange(gw // m), indexing="ij"
                )
                pos[:, start:stop] = cur + np.stack([tt, hh, ww]).reshape(3, -1)
                cur += max(gh, gw) // m
            at = stop
        positions[:, r, mask[r]] = pos
        deltas[r] = (pos.max() + 1 - n) if n else 0
    return positions, deltas


def sectioned_angles(
    positions: Int[Array, "k *b t"], inv_freq: np.ndarray, axis: np.ndarray
) -> CosSin:
    """cos and sin of ``positions[axis[j]] * inv_freq[j]`` per frequency ``j``, duplicated to the
    full head dim (the rotate-half layout; float32)."""
    pos = positions.astype(jnp.float32)[np.asarray(axis)]  # [f, *b, t]
    freqs = jnp.moveaxis(pos, 0, -1) * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def mrope_rotary(
    config: ModelConfig, positions: Int[Array, "3 b t"], mrope_section: tuple[int, ...]
) -> Rotary:
    """The language model's M-RoPE tables of ``positions`` ``[3, b, t]`` (module docstring), as the
    ``Rotary`` that ``run_layers(..., rope=...)`` takes. ``sum(mrope_section)`` must be
    ``head_dim / 2``."""
    inv = inverse_frequencies(config)
    if sum(mrope_section) != inv.shape[0]:
        raise ValueError(
            f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, but head_dim "
            f"{config.head_dim} has {inv.shape[0]} frequencies"
        )
    axis = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)
    cos, sin = sectioned_angles(positions, inv, axis)
    scale = attention_factor(config)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return Rotary(full=(cos, sin))
