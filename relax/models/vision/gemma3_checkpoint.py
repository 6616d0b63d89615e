"""Hugging Face ``Gemma3ForConditionalGeneration`` directories <-> relax (language model + vision).

    model, vision = load_gemma3("path/to/gemma-3-4b-it")   # a Transformer and a Gemma3Vision
    save_gemma3(model, vision, "out/")                       # loadable by transformers

``config.json`` holds ``text_config`` (a ``gemma3_text`` config, read by
``relax.models.hf.config``), ``vision_config`` (SigLIP), ``mm_tokens_per_image``,
``image_token_index`` (alias ``image_token_id``), ``boi_token_index``, ``eoi_token_index`` and the
top-level ``tie_word_embeddings``, the one transformers ties ``lm_head`` by (the text config's own
flag is not read by ``Gemma3ForConditionalGeneration``). Absent fields take transformers' defaults
(``Gemma3Config``, ``Gemma3TextConfig``, ``SiglipVisionConfig``).

Tensor names come in three spellings, all read:

=========================  ==================================  ===========================
part                       on the Hub (transformers 4.x)       transformers 5.x in memory
=========================  ==================================  ===========================
language model             ``language_model.model.*``          ``model.language_model.*``
untied head                ``language_model.lm_head.weight``   ``lm_head.weight``
vision tower               ``vision_tower.vision_model.*``     ``model.vision_tower.*``
projector                  ``multi_modal_projector.*``         ``model.multi_modal_projector.*``
=========================  ==================================  ===========================

and transformers 5.23's ``save_pretrained`` writes the Hub names but ``vision_tower.*`` without
``vision_model``. ``save_gemma3`` writes the Hub names, which transformers 4.x and 5.x load. A
SigLIP pooling head (``vision_tower...head.*``, present when ``vision_use_head``) is not used by
Gemma 3 and is skipped. Every error is an :class:`HFFormatError` naming the file and the tensor
(as the file spells it) or the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from relax.models.config.precision import Precision
from relax.models.decoder.transformer import Transformer
from relax.models.hf.checkpoint import build_transformer, load_config, save_directory
from relax.models.hf.config import HFFormatError
from relax.models.hf.reader import ConfigReader
from relax.models.hf.weights_io import FLOAT_DTYPES, SafetensorsFile, open_weights
from relax.models.vision.gemma3 import Gemma3Vision, Gemma3VisionConfig, Projector
from relax.models.vision.siglip import (
    from_hf,
    hf_shapes,
    siglip_config_from_hf,
    siglip_config_to_hf,
    to_hf,
)

__all__ = ["gemma3_config_from_hf", "load_gemma3", "save_gemma3"]

ARCHITECTURE = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults of the fields relax.models.hf.config requires
_TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
)
_TOP_DEFAULTS = dict(
    mm_tokens_per_image=256,
    image_token_index=262_144,
    boi_token_index=255_999,
    eoi_token_index=256_000,
)
# (part, stored prefix, relax's name prefix): the text part is renamed to relax's text-model names
_SPELLINGS = (
    ("text", "model.language_model.", "model."),
    ("text", "language_model.model.", "model."),
    ("text", "lm_head.weight", "lm_head.weight"),
    ("text", "language_model.lm_head.weight", "lm_head.weight"),
    ("vision", "model.vision_tower.vision_model.", ""),
    ("vision", "model.vision_tower.", ""),
    ("vision", "vision_tower.vision_model.", ""),
    ("vision", "vision_tower.", ""),
    ("projector", "model.multi_modal_projector.", ""),
    ("projector", "multi_modal_projector.", ""),
)
_SAVED = {
    "text": "language_model.",
    "vision": "vision_tower.vision_model.",
    "projector": "multi_modal_projector.",
}
_PROJECTOR = ("mm_soft_emb_norm.weight", "mm_input_projection_weight")


# ----------------------------------------------------------------------------- config


def gemma3_config_from_hf(d: dict, source: str) -> tuple[dict, Gemma3VisionConfig]:
    """(the ``text_config`` dict for ``relax.models.hf.config``, with transformers' defaults of
    the required fields and the top-level ``tie_word_embeddings``; the image side's config)."""
    r = ConfigReader(d, source)
    archs, mt = d.get("architectures"), d.get("model_type")
    if mt != "gemma3" and (not isinstance(archs, list) or ARCHITECTURE not in archs):
        raise r.fail(
            "model_type",
            f"= {mt!r} (architectures {archs!r}): not a Gemma 3 vision-language model "
            f"({ARCHITECTURE}, model_type 'gemma3')",
        )
    text = r.get("text_config", None)
    text = {} if text is None else text
    if not isinstance(text, dict):
        raise r.fail("text_config", f"must be an object, got {text!r}")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise r.fail("text_config.model_type", f"= {text['model_type']!r}, expected 'gemma3_text'")
    text = {**_TEXT_DEFAULTS, **text, "model_type": "gemma3_text"}
    text.pop("architectures", None)
    text["tie_word_embeddings"] = r.bool_("tie_word_embeddings", True)
    vision = siglip_config_from_hf(r.get("vision_config", None) or {}, source)
    if (
        "image_token_index" in d
        and "image_token_id" in d
        and d["image_token_index"] != d["image_token_id"]
    ):
        raise r.fail(
            "image_token_id",
            f"= {d['image_token_id']!r} disagrees with image_token_index {d['image_token_index']!r}",
        )
    image = (
        "image_token_index"
        if "image_token_index" in d or "image_token_id" not in d
        else "image_token_id"
    )
    ids = {
        k: r.int_(k, v, lo=1 if k == "mm_tokens_per_image" else 0)
        for k, v in _TOP_DEFAULTS.items()
        if k != "image_token_index"
    }
    try:
        return text, Gemma3VisionConfig(
            vision,
            mm_tokens_per_image=ids["mm_tokens_per_image"],
            image_token_id=r.int_(image, _TOP_DEFAULTS["image_token_index"], lo=0),
            boi_token_id=ids["boi_token_index"],
            eoi_token_id=ids["eoi_token_index"],
        )
    except ValueError as e:
        raise HFFormatError(f"{source}: {e}") from None


# ----------------------------------------------------------------------------- load


class _Renamed:
    """One safetensors file seen under other names (``names``: seen -> stored), for
    ``build_transformer``, which reads the language model under relax's text-model names."""

    def __init__(self, f: SafetensorsFile, names: dict[str, str]):
        self.path, self._f, self._names = f.path, f, names
        self.entries = {seen: f.entries[stored] for seen, stored in names.items()}

    def read(self, name: str) -> np.ndarray:
        return self._f.read(self._names[name])


def _split(where: dict[str, SafetensorsFile], use_head: bool) -> tuple[dict, dict, dict]:
    """The tensors by part: {relax text name: stored}, {tower name: stored}, {projector name: stored}."""
    parts: dict[str, dict[str, str]] = {"text": {}, "vision": {}, "projector": {}}
    for stored in where:
        hit = next(((p, pre, new) for p, pre, new in _SPELLINGS if stored.startswith(pre)), None)
        if hit is None:
            raise HFFormatError(
                f"{where[stored].path}: unexpected tensor {stored!r} (not part of a {ARCHITECTURE})"
            )
        part, pre, new = hit
        name = new + stored[len(pre) :]
        if part == "vision" and name.startswith("head.") and use_head:
            continue  # SigLIP's pooling head: Gemma 3 reads the last hidden states
        if name in parts[part]:
            raise HFFormatError(
                f"{where[stored].path}: tensor {stored!r} duplicates {parts[part][name]!r}"
            )
        parts[part][name] = stored
    return parts["text"], parts["vision"], parts["projector"]


def _language_model(cfg, where, names: dict[str, str], listing: str, **kw) -> Transformer:
    """``build_transformer`` on the text tensors seen under relax's names (``names``: relax's ->
    stored); its errors name the tensors as the file spells them (a missing one: as the Hub does)."""
    by_file: dict[int, dict[str, str]] = {}
    for name, stored in names.items():
        by_file.setdefault(id(where[stored]), {})[name] = stored
    views = {i: _Renamed(where[next(iter(ns.values()))], ns) for i, ns in by_file.items()}
    seen = {name: views[id(where[stored])] for name, stored in names.items()}
    try:
        return build_transformer(cfg, seen, listing, **kw)
    except HFFormatError as e:
        spell = lambda m: repr(names.get(m[1], _SAVED["text"] + m[1]))  # noqa: E731
        raise HFFormatError(re.sub(r"'((?:model\.|lm_head\.)[^']*)'", spell, str(e))) from None


def _tensor(where, stored: str, shape: tuple[int, ...], target) -> np.ndarray:
    """One tensor, checked (shape, float dtype, finite values), copied in the target dtype."""
    f = where[stored]
    code, have = f.entries[stored][:2]
    if have != shape:
        raise HFFormatError(
            f"{f.path}: tensor {stored!r} has shape {list(have)}, expected {list(shape)}"
        )
    if code not in FLOAT_DTYPES:
        raise HFFormatError(
            f"{f.path}: tensor {stored!r} has dtype {code}; relax loads floating-point "
            f"weights only ({', '.join(FLOAT_DTYPES)})"
        )
    a = np.array(f.read(stored))
    if not np.isfinite(a.astype(np.float32)).all():
        raise HFFormatError(f"{f.path}: tensor {stored!r} holds non-finite values")
    dt = target if target is not None else (np.float32 if a.dtype == np.float64 else a.dtype)
    return a.astype(dt)


def _vision(
    vc: Gemma3VisionConfig, text_hidden: int, where, names, proj_names, listing, target, dtype
) -> Gemma3Vision:
    """The tower and projector from their tensors (every one expected, none extra)."""
    dv = vc.vision.hidden_size
    for part, got, want in (
        ("vision tower", names, hf_shapes(vc.vision)),
        ("projector", proj_names, {_PROJECTOR[0]: (dv,), _PROJECTOR[1]: (dv, text_hidden)}),
    ):
        missing = [n for n in want if n not in got]
        if missing:
            prefix = (
                "multi_modal_projector." if part == "projector" else "vision_tower.vision_model."
            )
            raise HFFormatError(
                f"{listing}: missing {part} tensor {prefix + missing[0]!r}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )
        extra = sorted(set(got) - set(want))
        if extra:
            raise HFFormatError(
                f"{where[got[extra[0]]].path}: unexpected tensor {got[extra[0]]!r} (not part of the Gemma 3 {part})"
            )
    tower = {n: _tensor(where, names[n], s, target) for n, s in hf_shapes(vc.vision).items()}
    norm = _tensor(where, proj_names[_PROJECTOR[0]], (dv,), target)
    proj = _tensor(where, proj_names[_PROJECTOR[1]], (dv, text_hidden), target)
    return Gemma3Vision(
        from_hf(vc.vision, tower, dtype=dtype), Projector(jnp.asarray(norm), jnp.asarray(proj)), vc
    )


def load_gemma3(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    precision: Precision | None = None,
) -> tuple[Transformer, Gemma3Vision]:
    """The language model and the image encoder of a ``Gemma3ForConditionalGeneration`` directory
    (``config.json`` + safetensors; ``generation_config.json`` when present). ``dtype``: the compute
    dtype of both; ``param_dtype``: every parameter cast to it (None: as stored); ``precision``:
    the language model's precision policy (None: the default)."""
    root, found = Path(path), {}

    def adapt(d: dict, source: str) -> dict:
        text, found["vision"] = gemma3_config_from_hf(d, source)
        use_head = (d.get("vision_config") or {}).get("vision_use_head", True)
        if not isinstance(use_head, bool):
            raise HFFormatError(
                f"{source}: field 'vision_config.vision_use_head' must be true or false, got {use_head!r}"
            )
        found["use_head"] = use_head
        return text

    cfg = load_config(root, adapt)
    where, listing = open_weights(root)
    text, vis, proj = _split(where, found["use_head"])
    model = _language_model(cfg, where, text, listing, dtype=dtype, param_dtype=param_dtype)
    if precision is not None:
        model = dataclasses.replace(model, precision=precision)
    target = None if param_dtype is None else np.dtype(jnp.dtype(param_dtype))
    return model, _vision(
        found["vision"], cfg.hidden_size, where, vis, proj, listing, target, dtype
    )


# ----------------------------------------------------------------------------- save


def _config_json(vc: Gemma3VisionConfig, tie: bool):
    """The rewrite of the language model's ``config.json`` into a ``Gemma3Config``'s."""

    def wrap(text: dict) -> dict:
        text = {k: v for k, v in text.items() if k != "architectures"}
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": siglip_config_to_hf(vc.vision),
            "mm_tokens_per_image": vc.mm_tokens_per_image,
            "image_token_index": vc.image_token_id,
            "boi_token_index": vc.boi_token_id,
            "eoi_token_index": vc.eoi_token_id,
            "tie_word_embeddings": tie,
            "initializer_range": 0.02,
            "dtype": text["dtype"],
            "torch_dtype": text["torch_dtype"],
        }

    return wrap


def save_gemma3(
    model: Transformer,
    vision: Gemma3Vision,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    dtype=None,
) -> None:
    """Write a ``Gemma3ForConditionalGeneration`` directory transformers loads (the Hub's tensor
    names; ``save_pretrained``'s staging, sharding and ``dtype`` cast)."""
    if model.config.family != "gemma3_text":
        raise ValueError(f"the language model is a {model.config.family} model, not gemma3_text")
    if vision.projector.proj.shape[1] != model.config.hidden_size:
        raise ValueError(
            f"the projector maps to {vision.projector.proj.shape[1]} dims, the language model "
            f"has hidden_size {model.config.hidden_size}"
        )
    tower = {_SAVED["vision"] + n: a for n, a in to_hf(vision.tower).items()}
    arrays = (vision.projector.norm, vision.projector.proj)
    proj = {_SAVED["projector"] + n: np.asarray(a) for n, a in zip(_PROJECTOR, arrays)}
    save_directory(
        model,
        path,
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
        extra={**tower, **proj},
        tensor_name=lambda n: _SAVED["text"] + n,
        config_json=_config_json(vision.config, model.config.tie_word_embeddings),
    )
