"""Qwen2.5-VL checkpoints (``Qwen2_5_VLForConditionalGeneration`` directories) <-> ``Qwen2_5_VL``.

``config.json``: transformers 5.23 writes the language model's fields nested in ``text_config``
(``model_type`` ``qwen2_5_vl_text``; ``rope_parameters`` with ``mrope_section``); the Hub's
original files (transformers 4.x) have them at the top level (``rope_scaling`` ``{"type":
"mrope", "mrope_section": ...}``). Both are read; absent text fields take
``Qwen2_5_VLTextConfig``'s defaults (``rms_norm_eps`` 1e-5, ``rope_theta`` 1e6, 8 kv heads, ...,
not Qwen2's), the head dim is always ``hidden_size / num_attention_heads`` (the VL attention
ignores ``head_dim``), and the text part is read as a ``qwen2`` config by
``relax.models.hf.checkpoint.load_config`` (so ``generation_config.json`` applies too).
``tie_word_embeddings`` is the top level's (a ``true`` in ``text_config`` also ties, as
transformers' backward compatibility does).

Tensors: transformers 5.23 saves (and the Hub holds) ``model.embed_tokens.weight``,
``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight`` and ``visual.*``; its in-memory
names ``model.language_model.*`` / ``model.visual.*`` are read too (mapped to the former). The
language model loads through ``build_transformer`` (the tensor names in its errors are then the
saved layout's); the vision tensors are checked here (missing, unexpected, shape) by name.

Saving writes the Hub's flat layout through ``relax.models.hf.checkpoint.save_directory``: the
language model's ``config.json`` fields at the top level plus ``model_type`` ``qwen2_5_vl``,
``vision_config``, the token ids and ``rope_parameters.mrope_section``, and the vision tensors as
``visual.*`` -- what transformers loads (and what it would write back in its own layout).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from relax.models.hf.checkpoint import build_transformer, load_config, save_directory
from relax.models.hf.config import HFFormatError, config_to_hf
from relax.models.hf.reader import ConfigReader
from relax.models.hf.weights_io import FLOAT_DTYPES, open_weights, read_json
from relax.models.vision.qwen2_5_vl import Qwen2_5_VL, VLConfig
from relax.models.vision.qwen_vit import QwenVision, QwenVisionConfig, VisionBlocks, VisionMerger

__all__ = ["load_qwen2_5_vl", "read_vl_config", "save_qwen2_5_vl", "text_config_dict"]

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# transformers 5.23's Qwen2_5_VLTextConfig defaults for the fields relax reads
TEXT_DEFAULTS = dict(
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=80,
    rope_theta=1000000.0,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=None,
)
_VL_ONLY = ("vision_config", "text_config", "architectures", "model_type") + tuple(
    f.name for f in dataclasses.fields(VLConfig)
)
_BLOCK = {  # VisionBlocks field -> (name under visual.blocks.{i}., a torch Linear weight)
    "norm1": ("norm1.weight", False),
    "qkv": ("attn.qkv.weight", True),
    "qkv_bias": ("attn.qkv.bias", False),
    "proj": ("attn.proj.weight", True),
    "proj_bias": ("attn.proj.bias", False),
    "norm2": ("norm2.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up": ("mlp.up_proj.weight", True),
    "up_bias": ("mlp.up_proj.bias", False),
    "down": ("mlp.down_proj.weight", True),
    "down_bias": ("mlp.down_proj.bias", False),
}
_MERGER = {
    "ln_q": ("merger.ln_q.weight", False),
    "fc1": ("merger.mlp.0.weight", True),
    "fc1_bias": ("merger.mlp.0.bias", False),
    "fc2": ("merger.mlp.2.weight", True),
    "fc2_bias": ("merger.mlp.2.bias", False),
}
PATCH = "visual.patch_embed.proj.weight"


def _rope_dict(text: dict) -> tuple[str, dict]:
    """(the field, the RoPE parameters) as transformers picks them: ``rope_scaling``, else
    ``rope_parameters``."""
    field = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    return field, text.get(field) or {}


def text_config_dict(d: dict, source: str) -> dict:
    """The language model's part of a Qwen2.5-VL ``config.json`` as a ``qwen2`` one (the module
    docstring's rules): the ``adapt`` of ``load_config``."""
    r = ConfigReader(d, source)
    nested = r.get("text_config", None)
    if nested is not None and not isinstance(nested, dict):
        raise r.fail("text_config", f"must be an object, got {nested!r}")
    text = {k: v for k, v in d.items() if k not in _VL_ONLY} if nested is None else nested
    out = {**TEXT_DEFAULTS, **text, "model_type": "qwen2"}
    for k in ("architectures", "head_dim", "rope_scaling", "rope_parameters"):
        out.pop(k, None)
    field, rope = _rope_dict(text)
    if not isinstance(rope, dict):
        raise r.fail(field, f"must be an object or null, got {rope!r}")
    rope = {k: v for k, v in rope.items() if k != "mrope_section"}
    kind = rope.pop("type", None) or rope.get("rope_type", "default")
    rope["rope_type"] = "default" if kind == "mrope" else kind
    out["rope_parameters"] = rope
    out["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False)) or bool(
        text.get("tie_word_embeddings", False)
    )
    return out


def read_vl_config(d: dict, source: str) -> tuple[VLConfig, QwenVisionConfig]:
    """The multimodal fields and the ``vision_config`` of a parsed ``config.json``."""
    r = ConfigReader(d, source)
    arch = r.get("architectures", None)
    if r.get("model_type", "qwen2_5_vl") != "qwen2_5_vl" or arch not in (None, [ARCHITECTURE]):
        raise r.fail("model_type", f"/ architectures: not a Qwen2.5-VL ({ARCHITECTURE}) config")
    text = r.get("text_config", None) or d
    field, rope = _rope_dict(text)
    section = rope.get("mrope_section", [16, 24, 24]) if isinstance(rope, dict) else None
    if not (
        isinstance(section, list)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in section)
        and sum(section) > 0
    ):
        raise r.fail(
            f"{field}.mrope_section",
            f"must list non-negative integers (not all 0), got {section!r}",
        )
    dflt = VLConfig()
    ids = {
        f.name: r.int_(f.name, getattr(dflt, f.name), lo=0)
        for f in dataclasses.fields(VLConfig)
        if f.name.endswith("_id")
    }
    vision = r.get("vision_config", None) or {}
    if not isinstance(vision, dict):
        raise r.fail("vision_config", f"must be an object, got {vision!r}")
    return VLConfig(**ids, mrope_section=tuple(section)), QwenVisionConfig.from_hf(vision, source)


class _Renamed:
    """A ``SafetensorsFile`` whose tensors are seen under other names (``new -> old``)."""

    def __init__(self, f, names: dict[str, str]):
        self.path, self._file, self._old = f.path, f, names
        self.entries = {new: f.entries[old] for new, old in names.items()}

    def read(self, name: str) -> np.ndarray:
        return self._file.read(self._old[name])


def _saved_name(name: str) -> str:
    """The saved layout's name of a tensor (transformers' in-memory names mapped back)."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def _saved_layout(where: dict) -> dict:
    """``open_weights``' tensors under their saved-layout names (``_saved_name``)."""
    if all(_saved_name(n) == n for n in where):
        return where
    names: dict[int, dict[str, str]] = {}
    for n, f in where.items():
        names.setdefault(id(f), {})[_saved_name(n)] = n
    views = {id(f): _Renamed(f, names[id(f)]) for f in where.values()}
    return {_saved_name(n): views[id(f)] for n, f in where.items()}


def _vision_slots(c: QwenVisionConfig) -> dict[str, tuple[str, int | None, bool, tuple]]:
    """Saved name -> (field, layer or None, transposed, stored shape) of every vision tensor."""
    D, F, M = c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size**2
    block = dict(
        norm1=(D,), qkv=(3 * D, D), qkv_bias=(3 * D,), proj=(D, D), proj_bias=(D,), norm2=(D,),
        gate=(F, D), gate_bias=(F,), up=(F, D), up_bias=(F,), down=(D, F), down_bias=(D,),
    )  # fmt: skip
    merger = dict(ln_q=(D,), fc1=(M, M), fc1_bias=(M,), fc2=(c.out_hidden_size, M))
    merger["fc2_bias"] = (c.out_hidden_size,)
    slots = {
        f"visual.blocks.{i}.{name}": (field, i, t, block[field])
        for i in range(c.depth)
        for field, (name, t) in _BLOCK.items()
    }
    slots.update(
        {f"visual.{n}": (f, None, t, merger[f]) for f, (n, t) in _MERGER.items()},
    )
    p = c.patch_size
    slots[PATCH] = ("patch_embed", None, False, (D, c.in_channels, c.temporal_patch_size, p, p))
    return slots


def _load_vision(c: QwenVisionConfig, where: dict, listing: str, param_dtype, dtype) -> QwenVision:
    """The vision tower from the ``visual.*`` tensors of ``where`` (every one must belong to it),
    computing in ``dtype``."""
    slots = _vision_slots(c)
    present = {n for n in where if n.startswith("visual.")}
    missing = [n for n in slots if n not in present]
    if missing:
        raise HFFormatError(
            f"{listing}: missing vision tensor {missing[0]!r} ({len(missing)} in all)"
        )
    extra = sorted(present - set(slots))
    if extra:
        raise HFFormatError(f"{where[extra[0]].path}: unexpected vision tensor {extra[0]!r}")
    arrays: dict[str, list] = {}
    for name, (field, _, transpose, shape) in slots.items():
        f = where[name]
        code, stored = f.entries[name][:2]
        if stored != shape or code not in FLOAT_DTYPES:
            raise HFFormatError(
                f"{f.path}: tensor {name!r} is {code} {list(stored)}, expected a float "
                f"{list(shape)} (vision_config)"
            )
        a = np.asarray(f.read(name))
        a = a.reshape(shape[0], -1).T if field == "patch_embed" else (a.T if transpose else a)
        target = np.float32 if param_dtype is None and a.dtype == np.float64 else param_dtype
        arrays.setdefault(field, []).append(a if target is None else a.astype(np.dtype(target)))
    one = lambda f: jnp.asarray(arrays[f][0])  # noqa: E731
    return QwenVision(
        patch_embed=one("patch_embed"),
        blocks=VisionBlocks(**{f: jnp.asarray(np.stack(arrays[f])) for f in _BLOCK}),
        merger=VisionMerger(**{f: one(f) for f in _MERGER}),
        config=c,
        dtype=dtype,
    )


def load_qwen2_5_vl(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None) -> Qwen2_5_VL:
    """A ``Qwen2_5_VL`` from a transformers directory (``config.json``, safetensors; the module
    docstring's layouts). ``dtype``: the compute dtype of the language model and the vision tower;
    ``param_dtype``: every parameter's (None: as stored, float64 as float32). Errors are
    ``HFFormatError`` naming the file and field or tensor."""
    root = Path(path)
    text_cfg = load_config(root, text_config_dict)
    source = str(root / "config.json")
    d = read_json(root / "config.json")
    vl, vision_cfg = read_vl_config(d, source)
    if sum(vl.mrope_section) * 2 != text_cfg.head_dim:
        field = _rope_dict(d.get("text_config") or d)[0]
        raise HFFormatError(
            f"{source}: field '{field}.mrope_section' = {list(vl.mrope_section)} sums to "
            f"{sum(vl.mrope_section)}, expected head_dim / 2 = {text_cfg.head_dim // 2} "
            "(hidden_size / num_attention_heads / 2)"
        )
    where, listing = open_weights(root)
    where = _saved_layout(where)
    text = {n: f for n, f in where.items() if not n.startswith("visual.")}
    lm = build_transformer(text_cfg, text, listing, dtype=dtype, param_dtype=param_dtype)
    visual = _load_vision(vision_cfg, where, listing, param_dtype, dtype)
    return Qwen2_5_VL(language_model=lm, visual=visual, config=vl)


def _vision_tensors(v: QwenVision) -> dict[str, np.ndarray]:
    """The vision tower's tensors under their saved names, in transformers' layout."""
    out = {}
    for name, (field, layer, transpose, shape) in _vision_slots(v.config).items():
        if field == "patch_embed":
            out[name] = np.asarray(v.patch_embed).T.reshape(shape)
            continue
        a = np.asarray(
            getattr(v.blocks, field)[layer] if layer is not None else getattr(v.merger, field)
        )
        out[name] = a.T if transpose else a
    return out


def save_qwen2_5_vl(
    model: Qwen2_5_VL, path: str | os.PathLike, *, max_shard_bytes: int | None = None, dtype=None
) -> None:
    """Write ``model`` as a directory transformers loads as ``Qwen2_5_VLForConditionalGeneration``
    (the module docstring's layout; atomic, sharded and cast as ``save_pretrained``)."""
    lm, vl = model.language_model, model.config
    text = config_to_hf(lm.config, lm.embed.dtype if dtype is None else dtype)
    if text["head_dim"] != lm.config.hidden_size // lm.config.num_heads:
        raise ValueError(
            f"Qwen2.5-VL's head dim is hidden_size / num_heads = "
            f"{lm.config.hidden_size // lm.config.num_heads}, not {text['head_dim']}"
        )
    fields = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2_5_vl",
        "rope_scaling": None,
        "rope_parameters": {**text["rope_parameters"], "mrope_section": list(vl.mrope_section)},
        "vision_config": model.visual.config.to_hf(),
        **{f.name: getattr(vl, f.name) for f in dataclasses.fields(vl) if f.name.endswith("_id")},
    }
    save_directory(
        lm,
        path,
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
        extra=_vision_tensors(model.visual),
        hf_fields=fields,
    )
