"""Rotary position embeddings (the Hugging Face "rotate half" layout)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``, then the configured scaling.

    Llama 3 scaling (wavelength ``w = 2*pi/inv_freq``, original context ``C``)::

        w > C/low:   inv_freq / factor
        w < C/high:  inv_freq
        otherwise:   (1 - s) * inv_freq / factor + s * inv_freq,  s = (C/w - low) / (high - low)

    Computed in float32 on the host, as transformers does, so that angles match bit for bit.
    """
    d = config.head_dim
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    # llama3
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    ctx = scaling.original_max_position
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = ctx / low, ctx / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(inv_freq: np.ndarray, positions: Int[Array, "*b t"]) -> tuple[Float[Array, "*b t d"], Float[Array, "*b t d"]]:
    """cos and sin of ``position * inv_freq``, duplicated to the full head dim (float32)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Float[Array, "*b t h d"], cos: Float[Array, "*b t d"], sin: Float[Array, "*b t d"]) -> Float[Array, "*b t h d"]:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin
