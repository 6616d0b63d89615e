"""Gemma 3 with images (transformers' ``Gemma3ForConditionalGeneration``): the multimodal projector
and the language model's inputs for an image prompt.

An image becomes ``mm_tokens_per_image`` soft tokens (``Gemma3MultiModalProjector``)::

    h = SigLIP(pixels)                         [n, g*g, Dv]   (relax.models.vision.siglip)
    h = avg_pool_{k x k}(h on its g x g grid)  [n, s*s, Dv]   s = sqrt(mm_tokens_per_image), k = g / s
    f = ((1 + w) * rms_norm(h)) W_in           [n, s*s, D]    (Gemma's RMSNorm, eps: the tower's)

A prompt holds each image as ``<boi>`` then ``mm_tokens_per_image`` image tokens
(``image_token_id``) then ``<eoi>`` (``Gemma3Processor``'s layout). The language model's input is
the text embedding (times ``sqrt(D)``, ``relax.models.decoder.transformer.embed``) with the image
features written, unscaled, over the image tokens, in order: the i-th image token of the batch
(row-major) takes the i-th feature row of the images in order (transformers' ``masked_scatter``).

Attention: causal, plus **bidirectional within each image's block** (a maximal run of image
tokens, transformers' ``get_block_sequence_ids_for_mask``), the rule of
``relax.models.decoder.prompt_inputs``: full layers OR(causal, block), sliding layers
AND(window, OR(causal, block)) with the one-sided window ``q - k < W``, so in a sliding layer an
image token sees every later token of its block but earlier ones only within the window
(transformers' ``create_masks_for_vision_model``). Built by
``relax.models.decoder.transformer.full_attention`` from the blocks (ids > 0, 0 for text).
Positions count the valid tokens (left padding as in ``positions_from_mask``); RoPE positions
are the same (Gemma 3 has no multimodal RoPE).
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from relax.models.decoder.layer import rms_norm
from relax.models.decoder.prompt_inputs import PromptInputs, features_at, prompt_hidden_states
from relax.models.decoder.transformer import (
    Transformer,
    positions_from_mask,
    project,
)
from relax.models.layers.rope import rotary
from relax.models.vision.siglip import SiglipConfig, SiglipVision, siglip_forward

__all__ = [
    "Gemma3Vision",
    "Gemma3VisionConfig",
    "Projector",
    "check_image_tokens",
    "gemma3_prompt_inputs",
    "image_blocks",
    "image_features",
    "project_images",
    "vlm_hidden_states",
    "vlm_logits",
]


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """The image side of a ``Gemma3Config``: the SigLIP tower's config, the soft tokens per image
    and the special token ids (transformers' defaults: 256, 262144, 255999, 256000)."""

    vision: SiglipConfig
    mm_tokens_per_image: int = 256
    image_token_id: int = 262_144
    boi_token_id: int = 255_999
    eoi_token_id: int = 256_000

    def __post_init__(self):
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.vision.grid % side:
            raise ValueError(
                f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square s*s with s dividing "
                f"the {self.vision.grid} x {self.vision.grid} patch grid (image_size / patch_size)"
            )

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool(self) -> int:
        """The average pooling's kernel (and stride) on the patch grid."""
        return self.vision.grid // self.tokens_per_side


class Projector(eqx.Module):
    """``Gemma3MultiModalProjector``: ``norm`` (``mm_soft_emb_norm``, a ``1 + w`` RMSNorm) and
    ``proj`` (``mm_input_projection_weight``, ``[Dv, D]``, used as stored: ``x @ proj``)."""

    norm: Float[Array, " Dv"]
    proj: Float[Array, "Dv D"]


class Gemma3Vision(eqx.Module):
    """Gemma 3's image encoder: the SigLIP tower, the projector and their config."""

    tower: SiglipVision
    projector: Projector
    config: Gemma3VisionConfig = eqx.field(static=True)

    @property
    def vision_head_dim(self) -> int:
        """The tower's head width: where its head axes split on a mesh (``relax.parallel``)."""
        return self.config.vision.head_dim


def project_images(vision: Gemma3Vision, h: Float[Array, "n P Dv"]) -> Float[Array, "n m D"]:
    """Pool the patch states to ``mm_tokens_per_image`` per image, normalise and project (module
    docstring); the result in ``h``'s dtype (transformers' ``type_as``)."""
    c = vision.config
    n, _, dv = h.shape
    s, k = c.tokens_per_side, c.pool
    pooled = (
        h.astype(jnp.float32).reshape(n, s, k, s, k, dv).mean(axis=(2, 4)).reshape(n, s * s, dv)
    )
    normed = rms_norm(pooled.astype(h.dtype), vision.projector.norm, c.vision.layer_norm_eps, "1+w")
    dt = vision.tower.dtype
    out = jnp.einsum(
        "nmv,vd->nmd",
        normed.astype(dt),
        vision.projector.proj.astype(dt),
        preferred_element_type=jnp.float32,
    )
    return out.astype(h.dtype)


def image_features(
    vision: Gemma3Vision, pixel_values: Float[Array, "n C H W"]
) -> Float[Array, "n m D"]:
    """The soft tokens of each image (transformers' ``get_image_features(...).pooler_output``)."""
    return project_images(vision, siglip_forward(vision.tower, pixel_values))


def image_blocks(is_image: Bool[Array, "b t"]) -> Int[Array, "b t"]:
    """Each image token's block (maximal run of image tokens) numbered from 1 per row; 0 for text
    (``PromptInputs.blocks``)."""
    prev = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = is_image & ~prev
    return jnp.where(is_image, jnp.cumsum(starts.astype(jnp.int32), axis=1), 0)


def check_image_tokens(
    config: Gemma3VisionConfig, input_ids, attention_mask, image_rows, num_images: int
) -> None:
    """Raise ``ValueError`` naming the row whose count of image tokens is not its images' count
    times ``mm_tokens_per_image``. ``image_rows[i]``: the row of image ``i``, non-decreasing (the
    features are consumed in row order); None: only the batch's total is checked."""
    ids, valid = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    m, tok = config.mm_tokens_per_image, config.image_token_id
    counts = ((ids == tok) & valid).sum(axis=1)
    if image_rows is None:
        if counts.sum() != num_images * m:
            raise ValueError(
                f"{int(counts.sum())} image tokens (id {tok}) in the batch, expected {num_images} "
                f"image(s) x mm_tokens_per_image {m} = {num_images * m}"
            )
        return
    rows = np.asarray(image_rows, np.int64).reshape(-1)
    if len(rows) != num_images:
        raise ValueError(f"image_rows names {len(rows)} images, pixel_values holds {num_images}")
    if len(rows) and (rows.min() < 0 or rows.max() >= ids.shape[0] or np.any(np.diff(rows) < 0)):
        raise ValueError(
            f"image_rows={rows.tolist()} must be non-decreasing rows in [0, {ids.shape[0]})"
        )
    per_row = np.bincount(rows, minlength=ids.shape[0])
    for b, (have, n) in enumerate(zip(counts, per_row)):
        if have != n * m:
            raise ValueError(
                f"row {b}: {int(have)} image tokens (id {tok}), expected {int(n)} image(s) x "
                f"mm_tokens_per_image {m} = {int(n * m)}"
            )


def gemma3_prompt_inputs(
    model: Transformer,
    vision: Gemma3Vision,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"],
    pixel_values: Float[Array, "n C H W"] | None,
) -> PromptInputs:
    """Image prompts' inputs to the layers: embeddings with the image features in place
    (``relax.models.decoder.prompt_inputs.features_at``; unscaled, as transformers: only the
    text embeddings are multiplied by sqrt(D)), RoPE tables of ``positions_from_mask``, the next position (the valid
    length) and the image blocks. No check of the image-token counts (``check_image_tokens``)."""
    valid = attention_mask.astype(bool)
    is_image = (input_ids == vision.config.image_token_id) & valid
    if pixel_values is None or not pixel_values.shape[0]:
        features = jnp.zeros((*input_ids.shape, model.config.hidden_size), model.dtype)
    else:
        flat = image_features(vision, pixel_values)
        features = features_at(is_image, flat.reshape(-1, flat.shape[-1]), model.dtype)
    return PromptInputs(
        features=features,
        is_image=is_image,
        rope=rotary(model.config, positions_from_mask(attention_mask)),
        next_position=jnp.sum(attention_mask.astype(jnp.int32), axis=1),
        blocks=image_blocks(is_image),
    )


@eqx.filter_jit
def _hidden_states(model, vision, input_ids, attention_mask, pixel_values):
    inputs = gemma3_prompt_inputs(model, vision, input_ids, attention_mask, pixel_values)
    return prompt_hidden_states(model, input_ids, attention_mask, inputs)


def vlm_hidden_states(
    model: Transformer,
    vision: Gemma3Vision,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    pixel_values: Float[Array, "n C H W"] | None = None,
    image_rows: Int[Array, " n"] | None = None,
) -> Float[Array, "b t D"]:
    """Final-norm hidden states of image prompts. ``pixel_values``: every image of the batch in
    row order (None: no image); ``image_rows``: each image's row, checked against the rows' image
    tokens when the ids are concrete (None: images in order, only the total checked)."""
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    n = 0 if pixel_values is None else pixel_values.shape[0]
    if not any(isinstance(a, jax.core.Tracer) for a in (input_ids, attention_mask, image_rows)):
        check_image_tokens(vision.config, input_ids, attention_mask, image_rows, n)
    return _hidden_states(
        model, vision, jnp.asarray(input_ids), jnp.asarray(attention_mask), pixel_values
    )


def vlm_logits(
    model: Transformer,
    vision: Gemma3Vision,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    pixel_values: Float[Array, "n C H W"] | None = None,
    image_rows: Int[Array, " n"] | None = None,
) -> Float[Array, "b t V"]:
    """Logits ``[b, t, V]`` (float32) of image prompts over the full sequence (``vlm_hidden_states``)."""
    return project(
        model, vlm_hidden_states(model, vision, input_ids, attention_mask, pixel_values, image_rows)
    )
