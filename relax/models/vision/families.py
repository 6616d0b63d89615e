"""One record per supported vision-language family, and loading / saving by ``config.json``.

A :class:`VisionFamily` names a family's Hugging Face ``model_type`` and architecture, the relax
family of its language model, and its checkpoint functions. ``load_vision_language(path)``
reads any of them into a :class:`VisionLanguage`: the language model (a plain ``Transformer``,
what every trainer and the sampler run) and the vision part (the tower and its projection,
frozen by default), which gives an image prompt's ``PromptInputs``. The model types are also
listed in ``relax.models.config.vision_language.VISION_LANGUAGE``, so that the text loader
(``load_pretrained``) refuses such a directory with a pointer here.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from relax.models.adapters.tower import add_module_lora, merged_module
from relax.models.config.vision_language import VISION_LANGUAGE
from relax.models.decoder.prompt_inputs import PromptInputs, features_at
from relax.models.decoder.transformer import Transformer
from relax.models.hf.config import HFFormatError
from relax.models.hf.weights_io import read_json
from relax.models.layers.lora import LoRAConfig
from relax.models.vision.gemma3 import Gemma3Vision, check_image_tokens, gemma3_prompt_inputs
from relax.models.vision.gemma3 import image_features as gemma3_features
from relax.models.vision.gemma3_checkpoint import load_gemma3, save_gemma3
from relax.models.vision.qwen2_5_vl import Qwen2_5_VL, prepare_inputs
from relax.models.vision.qwen2_5_vl import image_features as qwen_features
from relax.models.vision.qwen2_5_vl import prompt_inputs as qwen_prompt_inputs
from relax.models.vision.qwen2_5_vl_checkpoint import load_qwen2_5_vl, save_qwen2_5_vl

__all__ = [
    "VISION_FAMILIES",
    "Pixels",
    "VisionFamily",
    "VisionLanguage",
    "encode_images",
    "image_token_features",
    "load_vision_language",
    "pixels_of",
    "save_vision_language",
    "trainable_vision",
    "vision_family_of",
    "with_image_features",
]


class Pixels(eqx.Module):
    """A batch's images as its family's vision tower takes them: ``values`` (Gemma 3: ``[n, 3,
    H, W]``; Qwen2.5-VL: every image's patch rows ``[sum t h w, C T P P]``) and ``grid`` (static:
    Qwen2.5-VL's ``(t, h, w)`` per image; Gemma 3: empty). A jitted program that takes them
    compiles for each ``grid`` and shape."""

    values: Float[Array, "..."]
    grid: tuple[tuple[int, int, int], ...] = eqx.field(static=True)


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    """``model_type`` / ``architecture``: transformers' names; ``text_family``: the relax family
    of the language model; ``load(path, dtype=, param_dtype=) -> (language model, vision)``,
    ``save(language model, vision, path)`` and ``encode(language model, vision, prompt_ids,
    prompt_mask, pixel_values, grid, tower=True) -> PromptInputs`` (the vision tower once per
    image; ``tower=False``: the features left at zero);
    ``features(vision, pixels) -> [n, D]``: the features of every image token, in order (the
    tower and its projection, jittable: what a trained tower's gradient flows through);
    ``vision_type``: the class of its vision part. ``lora_modules``: the linear weights of the
    vision part that ``--lora.vision`` adapts (paths from the part down) and each one's module in
    transformers' class (``{i}``: its layer), under which PEFT names their adapters.
    ``peft_prefix``: the language model's module path in transformers' class, under which PEFT
    names its adapters (``base_model.model.{peft_prefix}.layers.{i}...``; a causal LM's is
    ``model``), for ``relax.models.adapters.peft.save_adapter`` / ``load_adapter``'s ``prefix``."""

    model_type: str
    architecture: str
    text_family: str
    load: Callable[..., tuple[Transformer, Any]]
    save: Callable[[Transformer, Any, str | os.PathLike], None]
    encode: Callable[..., PromptInputs]
    features: Callable[[Any, Pixels], Float[Array, "n D"]]
    vision_type: type
    lora_modules: dict[str, str]
    peft_prefix: str = "model.language_model"  # transformers 5's layout of both families


class VisionLanguage(NamedTuple):
    """A loaded vision-language model: its family, its language model and its vision part."""

    family: VisionFamily
    language_model: Transformer
    vision: Any


def _load_qwen(path, **kw) -> tuple[Transformer, Qwen2_5_VL]:
    """The language model apart and the rest without it (the policy is trained; the vision part
    must not hold the loaded weights alive)."""
    m = load_qwen2_5_vl(path, **kw)
    return m.language_model, dataclasses.replace(m, language_model=None)


def _save_qwen(lm: Transformer, vision: Qwen2_5_VL, path) -> None:
    save_qwen2_5_vl(dataclasses.replace(vision, language_model=lm), path)


def _encode_gemma3(
    lm, vision, prompt_ids, prompt_mask, pixel_values, grid, *, tower: bool = True
) -> PromptInputs:
    """Gemma 3's inputs, the batch's image tokens first counted against its images (each
    ``mm_tokens_per_image``): a processor that expands an image to another count would have
    each image's features misplaced (``ValueError``, never silently). ``tower=False``: the
    features left at zero (the tower not run)."""
    pixels = None if pixel_values is None or not len(pixel_values) else jnp.asarray(pixel_values)
    n = 0 if pixels is None else int(pixels.shape[0])
    check_image_tokens(vision.config, prompt_ids, prompt_mask, None, n)
    pixels = pixels if tower else None
    return _gemma3_inputs(lm, vision, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), pixels)


def _encode_qwen(
    lm, vision, prompt_ids, prompt_mask, pixel_values, grid, *, tower: bool = True
) -> PromptInputs:
    """Qwen2.5-VL's inputs (``tower=False``: the features left at zero, the M-RoPE positions
    still the images')."""
    m = dataclasses.replace(vision, language_model=lm)
    x = prepare_inputs(m, np.asarray(prompt_ids), np.asarray(prompt_mask), grid)
    run = bool(grid) and tower
    pixels = jnp.asarray(pixel_values) if run else None
    ids, mask = jnp.asarray(x.input_ids, jnp.int32), jnp.asarray(x.attention_mask, jnp.int32)
    positions = jnp.asarray(x.positions, jnp.int32)
    return qwen_prompt_inputs(m, ids, mask, positions, pixels, x.grid if run else ())


def _gemma3_features(vision: Gemma3Vision, pixels: Pixels) -> Float[Array, "n D"]:
    f = gemma3_features(vision, pixels.values)
    return f.reshape(-1, f.shape[-1])


def _qwen_features(vision: Qwen2_5_VL, pixels: Pixels) -> Float[Array, "n D"]:
    return qwen_features(vision.visual, pixels.values, pixels.grid)


_gemma3_inputs = eqx.filter_jit(gemma3_prompt_inputs)

VISION_FAMILIES = {
    "gemma3": VisionFamily(
        "gemma3",
        VISION_LANGUAGE["gemma3"],
        "gemma3_text",
        load_gemma3,
        save_gemma3,
        _encode_gemma3,
        _gemma3_features,
        Gemma3Vision,
        {
            f"tower.layers.{field}": f"model.vision_tower.encoder.layers.{{i}}.{name}"
            for field, name in (
                ("wq", "self_attn.q_proj"),
                ("wk", "self_attn.k_proj"),
                ("wv", "self_attn.v_proj"),
                ("wo", "self_attn.out_proj"),
                ("w1", "mlp.fc1"),
                ("w2", "mlp.fc2"),
            )
        },
    ),
    "qwen2_5_vl": VisionFamily(
        "qwen2_5_vl",
        VISION_LANGUAGE["qwen2_5_vl"],
        "qwen2",
        _load_qwen,
        _save_qwen,
        _encode_qwen,
        _qwen_features,
        Qwen2_5_VL,
        {
            "visual.blocks.qkv": "model.visual.blocks.{i}.attn.qkv",
            "visual.blocks.proj": "model.visual.blocks.{i}.attn.proj",
            "visual.blocks.gate": "model.visual.blocks.{i}.mlp.gate_proj",
            "visual.blocks.up": "model.visual.blocks.{i}.mlp.up_proj",
            "visual.blocks.down": "model.visual.blocks.{i}.mlp.down_proj",
            "visual.merger.fc1": "model.visual.merger.mlp.0",
            "visual.merger.fc2": "model.visual.merger.mlp.2",
        },
    ),
}


def vision_family_of(path: str | os.PathLike) -> VisionFamily | None:
    """The vision-language family of the model directory ``path`` (its ``config.json``'s
    ``model_type``), or None for a text model."""
    d = read_json(Path(path) / "config.json")
    mt = d.get("model_type") if isinstance(d, dict) else None
    return VISION_FAMILIES.get(mt) if isinstance(mt, str) else None


def load_vision_language(
    path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None
) -> VisionLanguage:
    """The language model and vision part of a vision-language directory (``HFFormatError``
    naming ``config.json`` for a text model or an unknown ``model_type``)."""
    family = vision_family_of(path)
    if family is None:
        raise HFFormatError(
            f"{Path(path) / 'config.json'}: field 'model_type' is not a vision-language model "
            f"(supported: {sorted(VISION_FAMILIES)}); a text model loads with load_pretrained"
        )
    lm, vision = family.load(path, dtype=dtype, param_dtype=param_dtype)
    return VisionLanguage(family, lm, vision)


def encode_images(
    model: VisionLanguage,
    language_model: Transformer,
    prompt_ids,
    prompt_mask,
    images,
    *,
    features: bool = True,
) -> PromptInputs:
    """Image prompts' ``PromptInputs`` for ``language_model`` (the policy being trained: only its
    config and dtype are read, its embeddings are looked up in each forward): ``images`` a
    batch's ``pixel_values`` and ``grid`` (``relax.data.image_prompts.ImageBatch``), the vision
    tower run once per image. ``features=False``: their features left at zero, the tower not
    run (a trained tower computes them in the step, ``with_image_features``)."""
    shape_only = eqx.filter(language_model, lambda _: False)  # no weights cross into the call
    args = (shape_only, model.vision, prompt_ids, prompt_mask, images.pixel_values, images.grid)
    return model.family.encode(*args) if features else model.family.encode(*args, tower=False)


def pixels_of(images) -> Pixels | None:
    """A batch's images (``relax.data.image_prompts.ImageBatch``: ``pixel_values``, ``grid``) as
    ``Pixels`` on the device; None when it has none."""
    if images is None or not len(images.pixel_values):
        return None
    return Pixels(jnp.asarray(images.pixel_values), tuple(images.grid))


def image_token_features(vision: Any, pixels: Pixels) -> Float[Array, "n D"]:
    """The features of every image token of ``pixels`` by ``vision``'s family (a tower with
    adapters runs merged; ``TypeError`` for a part of no family)."""
    vision = merged_module(vision)
    for family in VISION_FAMILIES.values():
        if isinstance(vision, family.vision_type):
            return family.features(vision, pixels)
    raise TypeError(
        f"{type(vision).__name__} is the vision part of no family {sorted(VISION_FAMILIES)}"
    )


def with_image_features(inputs: PromptInputs, vision: Any, pixels: Pixels | None) -> PromptInputs:
    """``inputs`` with the image tokens' features computed by ``vision`` (a trained tower: the
    inputs' RoPE, blocks and image tokens are the images', whatever tower encoded them); as they
    are when ``pixels`` is None (no image)."""
    if pixels is None:
        return inputs
    flat = image_token_features(vision, pixels)
    return inputs._replace(features=features_at(inputs.is_image, flat, inputs.features.dtype))


def trainable_vision(model: VisionLanguage, lora: LoRAConfig, key: jax.Array) -> Any:
    """The vision part a run trains (``--train-vision``, ``--lora.vision``): a copy of
    ``model``'s, which stays the initial tower (the reference's features), with adapters of
    ``lora`` on its family's ``lora_modules`` when ``lora.vision`` (``key``: their ``A``)."""
    part = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model.vision)
    if not lora.vision:
        return part
    if lora.dropout > 0:
        warnings.warn(
            f"--lora.dropout {lora.dropout} applies to the language model's adapters; the "
            "tower's run merged into its weights and take no dropout",
            stacklevel=2,
        )
    return add_module_lora(part, tuple(model.family.lora_modules), lora, key)


def save_vision_language(model: VisionLanguage, path: str | os.PathLike) -> None:
    """Write ``model`` as a directory transformers loads as its family's architecture."""
    model.family.save(model.language_model, model.vision, path)
