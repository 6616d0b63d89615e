"""Rotary position embeddings (the Hugging Face "rotate half" layout), one table per RoPE kind.

A model's layers use one RoPE, or two (Gemma 3): the full-attention layers' (``rope_theta``,
``rope_scaling``) and the sliding layers' own (``rope_local_theta``, unscaled). ``rotary``
computes the cos/sin tables of some positions for each kind once; every layer then reads its
kind's (``layer_rotary``), a select when the layer's kind is a traced scanned flag.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.models.config.layer_kinds import Kind, select
from relax.models.config.model import ModelConfig

CosSin = tuple[Float[Array, "*b t d"], Float[Array, "*b t d"]]


def has_local_rope(config: ModelConfig) -> bool:
    """Whether the sliding layers rotate with their own RoPE base (and some layer is sliding)."""
    return config.rope_local_theta is not None and any(config.sliding_layers)


def inverse_frequencies(config: ModelConfig, *, local: bool = False) -> np.ndarray:
    """``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``, then the configured scaling. ``local``:
    the sliding layers' RoPE (``theta = rope_local_theta``, no scaling).

    Llama 3 scaling (wavelength ``w = 2*pi/inv_freq``, original context ``C``)::

        w > C/low:   inv_freq / factor
        w < C/high:  inv_freq
        otherwise:   (1 - s) * inv_freq / factor + s * inv_freq,  s = (C/w - low) / (high - low)

    LongRoPE (Phi-3): ``inv_freq[i] / short_factor[i]`` (``RopeScaling``: transformers' choice
    for sequences up to ``original_max_position``, the most relax runs).

    Computed in float32 on the host, as transformers does, so that angles match bit for bit.
    """
    d = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv = (
        1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    ).astype(np.float32)
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    if (
        scaling.kind == "longrope"
    ):  # the short factors: relax runs at most original_max_position positions
        return (inv / np.asarray(scaling.short_factor, np.float32)).astype(np.float32)
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


def attention_factor(config: ModelConfig, *, local: bool = False) -> float:
    """The factor cos and sin are multiplied by: LongRoPE's ``attention_factor``, else 1."""
    s = None if local else config.rope_scaling
    return 1.0 if s is None else s.attention_factor


def rope_angles(inv_freq: np.ndarray, positions: Int[Array, "*b t"], scale: float = 1.0) -> CosSin:
    """cos and sin of ``position * inv_freq``, duplicated to the full head dim, times ``scale``
    (float32; transformers multiplies its tables the same way)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos, sin


class Rotary(NamedTuple):
    """cos/sin tables of the same positions per RoPE kind: ``full`` (every layer of a model with
    one RoPE) and ``local`` (the sliding layers' own; None when they have none)."""

    full: CosSin
    local: CosSin | None = None


def rotary(config: ModelConfig, positions: Int[Array, "*b t"]) -> Rotary:
    """The tables of ``positions`` for every RoPE kind the model's layers use."""
    full = rope_angles(inverse_frequencies(config), positions, attention_factor(config))
    if not has_local_rope(config):
        return Rotary(full)
    return Rotary(
        full,
        rope_angles(
            inverse_frequencies(config, local=True), positions, attention_factor(config, local=True)
        ),
    )


def layer_rotary(tables: Rotary, sliding: Kind) -> CosSin:
    """The tables of a layer of kind ``sliding`` (a Python bool, or a traced flag scanned with
    the layers: then a select of the two tables)."""
    return tables.full if tables.local is None else select(sliding, tables.local, tables.full)


def apply_rope(
    x: Float[Array, "*b t h d"], cos: Float[Array, "*b t d"], sin: Float[Array, "*b t d"]
) -> Float[Array, "*b t h d"]:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin
