"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``): the full-sequence forward.

The language model is relax's ``qwen2`` ``Transformer`` (q/k/v biases, RMSNorm, SwiGLU); the
vision tower is ``relax.models.vision.qwen_vit``. One forward::

    e = embed(input_ids);  e[image tokens] = vision(pixel_values, grid)   (in token order, row 0 first)
    pos = get_rope_index(input_ids, mask, grid)                            ([3, b, t], host numpy)
    h = layers(e, rope = M-RoPE(pos), attend = causal over the valid tokens);  logits = h head^T

The causal mask is by token order (the 1-D positions of the valid tokens,
``positions_from_mask``), not by the M-RoPE positions, which repeat inside an image. A
prompt's images are runs of ``image_token_id`` (``<|vision_start|>``, the ``t*h*w / m^2`` image
pad tokens, ``<|vision_end|>``), each taking the next ``image_grid_thw`` entry; a run whose length
differs from its grid's is a ``ValueError`` naming the row (``relax.models.vision.mrope.image_spans``).
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.models.decoder.prompt_inputs import PromptInputs, features_at, prompt_hidden_states
from relax.models.decoder.transformer import (
    Transformer,
    project,
)
from relax.models.vision.mrope import Grid, get_rope_index, mrope_rotary
from relax.models.vision.qwen_vit import QwenVision, vision_forward

__all__ = [
    "Qwen2_5_VL",
    "VLConfig",
    "VLInputs",
    "image_features",
    "prepare_inputs",
    "prompt_inputs",
    "vl_forward",
    "vl_logits",
]


@dataclasses.dataclass(frozen=True)
class VLConfig:
    """The multimodal fields of ``config.json`` (defaults: transformers 5.23's ``Qwen2_5_VLConfig``)
    and the text RoPE's ``mrope_section`` (``rope_parameters``; default ``[16, 24, 24]``)."""

    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    mrope_section: tuple[int, ...] = (16, 24, 24)


class Qwen2_5_VL(eqx.Module):
    """The language model (``qwen2`` family), the vision tower and the multimodal config."""

    language_model: Transformer
    visual: QwenVision
    config: VLConfig = eqx.field(static=True)

    @property
    def vision_head_dim(self) -> int:
        """The tower's head width: where its head axes split on a mesh (``relax.parallel``)."""
        return self.visual.config.head_dim


@dataclasses.dataclass(frozen=True)
class VLInputs:
    """One batch on the host: ``input_ids`` / ``attention_mask`` ``[b, t]``, the M-RoPE
    ``positions`` ``[3, b, t]`` and ``rope_deltas`` ``[b]`` (``get_rope_index``), the images'
    ``grid`` (static ``(t, h, w)`` tuples; empty: none)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    rope_deltas: np.ndarray
    grid: Grid


def prepare_inputs(
    model: Qwen2_5_VL,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    image_grid_thw: np.ndarray | Grid | None = None,
) -> VLInputs:
    """Host side of a forward: the positions of every token (raises ``ValueError`` naming the
    row whose image tokens do not match their grid)."""
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
    grid = tuple(
        tuple(int(x) for x in g) for g in (() if image_grid_thw is None else image_grid_thw)
    )
    m = model.visual.config.spatial_merge_size
    positions, deltas = get_rope_index(ids, mask, model.config.image_token_id, grid, m)
    return VLInputs(ids, mask, positions, deltas, grid)


def image_features(
    visual: QwenVision, pixel_values: Float[Array, "N P"], grid: Grid
) -> Float[Array, "n D"]:
    """The merged features of every image, in order, each image's tower run on its own patches
    (images of one grid under one ``lax.map``): attention costs the sum over images of their
    squared patch counts, not the square of the batch's (``vision_forward`` over several grids
    at once masks one dense matrix of all their patches)."""
    sizes = [t * h * w for t, h, w in grid]
    starts = np.cumsum([0, *sizes])
    out: list = [None] * len(grid)
    for g in dict.fromkeys(grid):  # each distinct grid once, in order of appearance
        idx = [i for i, x in enumerate(grid) if x == g]
        stacked = jnp.stack([pixel_values[starts[i] : starts[i + 1]] for i in idx])
        feats = jax.lax.map(lambda px, g=g: vision_forward(visual, px, (g,)), stacked)
        for j, i in enumerate(idx):
            out[i] = feats[j]
    return jnp.concatenate(out)


@functools.partial(jax.jit, static_argnames=("grid",))
def vl_logits(
    model: Qwen2_5_VL,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"],
    positions: Int[Array, "3 b t"],
    pixel_values: Float[Array, "N P"] | None,
    grid: Grid,
) -> Float[Array, "b t V"]:
    """The logits ``[b, t, V]`` (float32) of a prepared batch (module docstring)."""
    lm = model.language_model
    inputs = prompt_inputs(model, input_ids, attention_mask, positions, pixel_values, grid)
    return project(lm, prompt_hidden_states(lm, input_ids, attention_mask, inputs))


@functools.partial(jax.jit, static_argnames=("grid",))
def prompt_inputs(
    model: Qwen2_5_VL,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    positions: Int[Array, "3 p lp"],
    pixel_values: Float[Array, "N P"] | None,
    grid: Grid,
) -> PromptInputs:
    """The inputs of a batch of left-padded image prompts to the language model's layers
    (``relax.models.decoder.prompt_inputs``), the vision tower run once per image: what the
    sampler prefills and the prefix-shared training forward reads, once per prompt group.
    ``positions``: ``prepare_inputs(...).positions``. Completion tokens are text: token ``t``
    sits at ``max(positions) + 1 + t`` on all three axes (transformers' ``rope_deltas``), where
    M-RoPE equals the 1-D RoPE."""
    lm = model.language_model
    valid = prompt_mask.astype(bool)
    is_image = (prompt_ids == model.config.image_token_id) & valid
    if grid:
        features = features_at(is_image, image_features(model.visual, pixel_values, grid), lm.dtype)
    else:
        features = jnp.zeros((*prompt_ids.shape, lm.config.hidden_size), lm.dtype)
    top = jnp.max(jnp.where(valid[None], positions, -1), axis=(0, 2))
    return PromptInputs(
        features=features,
        is_image=is_image,
        rope=mrope_rotary(lm.config, positions, model.config.mrope_section),
        next_position=(top + 1).astype(jnp.int32),
        blocks=jnp.zeros(prompt_ids.shape, jnp.int32),
    )


def vl_forward(
    model: Qwen2_5_VL,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | Grid | None = None,
) -> Float[Array, "b t V"]:
    """``prepare_inputs`` then ``vl_logits``: the logits of a batch of prompts with images.

    Args:
        model: a ``Qwen2_5_VL``.
        input_ids: ``[b, t]`` token ids, each image as its run of ``image_token_id``.
        attention_mask: ``[b, t]`` 1 for real tokens, 0 for (left) padding; None: all 1.
        pixel_values: ``[sum t*h*w, C*tp*p*p]`` the images' patches (the processor's layout), or
            None without images.
        image_grid_thw: ``[n_images, 3]`` each image's ``(t, h, w)`` patches, in token order.

    Returns:
        Float32 logits ``[b, t, V]`` (padding rows are not meaningful).
    """
    x = prepare_inputs(model, input_ids, attention_mask, image_grid_thw)
    if bool(x.grid) != (pixel_values is not None):
        raise ValueError(
            f"pixel_values is {'None' if pixel_values is None else 'given'} but image_grid_thw "
            f"lists {len(x.grid)} image(s)"
        )
    pv = None if not x.grid else jnp.asarray(pixel_values)
    return vl_logits(
        model,
        jnp.asarray(x.input_ids, jnp.int32),
        jnp.asarray(x.attention_mask, jnp.int32),
        jnp.asarray(x.positions, jnp.int32),
        pv,
        x.grid,
    )
