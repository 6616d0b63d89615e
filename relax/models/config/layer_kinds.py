"""The kind of each layer, full or sliding (``ModelConfig.sliding_layers``), as layer code sees it.

A sliding layer attends through the model's ``sliding_window`` and rotates with its local RoPE
when it has one (``relax.models.layers.rope``). Where every layer is of one kind, or the layers run as
a Python loop, a layer's kind is a static Python bool and its code is specialised on it (the
Llama, Mistral and Qwen paths: no per-layer arrays, nothing selected). Where the kinds differ
and the layers run as one ``lax.scan`` (Gemma 3: five sliding layers to one full), the kinds are
scanned with the layers as a ``[L]`` bool array and each layer selects between values of both
kinds computed once (masks, RoPE tables) or a traced window.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from relax.models.config.model import ModelConfig

Kind = bool | Bool[Array, ""]
NO_WINDOW = np.iinfo(np.int32).max  # the traced window of a full layer: masks nothing
T = TypeVar("T")


def scanned_kinds(config: ModelConfig) -> Bool[Array, " L"] | None:
    """The ``[L]`` sliding flags to scan with the stacked layers; None when all layers are alike."""
    kinds = config.sliding_layers
    return None if len(set(kinds)) == 1 else jnp.asarray(kinds)


def layer_kind(config: ModelConfig, scanned: Bool[Array, ""] | None) -> Kind:
    """What a scanned layer body sees: its scanned flag, or the common static kind."""
    return config.sliding_layers[0] if scanned is None else scanned


def select(sliding: Kind, if_sliding: T, if_full: T) -> T:
    """``if_sliding`` or ``if_full`` (pytrees of one structure), per a static or traced kind."""
    if isinstance(sliding, bool):
        return if_sliding if sliding else if_full
    return jax.tree.map(lambda s, f: jnp.where(sliding, s, f), if_sliding, if_full)


def layer_window(config: ModelConfig, sliding: Kind) -> int | None | Int[Array, ""]:
    """The attention window of a layer of kind ``sliding``: ``sliding_window`` or None (no
    window), static; for a traced kind an int32 scalar, ``NO_WINDOW`` on full layers."""
    w = config.sliding_window
    if w is None:
        return None
    if isinstance(sliding, bool):
        return w if sliding else None
    return jnp.where(sliding, jnp.int32(w), jnp.int32(NO_WINDOW))
