"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

A family's fixed traits, its ``config.json`` spelling of biases, windows and RoPE, and the
defaults of absent fields come from its record (``relax.models.config.families``), found by
``model_type`` / ``architectures``; everything else from the file's fields.

Reads both layouts found on the hub: transformers 4.x (top-level
``rope_theta``, ``rope_scaling`` with ``rope_type`` or the older ``type``, ``torch_dtype``) and
5.x (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields, ``dtype``).
A field a file leaves out takes the default transformers 5.23 gives it for that family, so
relax builds the model transformers would build (e.g. an absent ``num_key_value_heads`` is 8 for
Mistral and 32 for Qwen2/Qwen3; an absent ``head_dim`` is 128 for Qwen3 and 256 for Gemma 3,
whose absent ``layer_types`` follow ``sliding_window_pattern``, default 6). An explicit
``null`` ``head_dim`` / ``num_key_value_heads`` means ``hidden/heads`` / ``num_attention_heads``.

Mixture-of-experts fields are read and written by ``relax.models.hf.moe``, the RoPE fields by
``relax.models.hf.rope``; the typed reader and :class:`HFFormatError` live in
``relax.models.hf.reader`` (and are importable from here too).

Phi-3's LongRoPE reads as ``RopeScaling("longrope")``; a context beyond its original length is
refused unless ``max_positions`` caps it there (``RopeScaling``: static tables cannot switch factors).

Sizes, RoPE numbers and ``rms_norm_eps`` are bounded from the file alone (``relax.models.hf.limits``:
e.g. at most 10,000 layers, positions in ``[1, 2**24]``), so an absurd value fails before any
per-layer work; ``relax.models.hf.validate`` checks the rest against the checkpoint's tensors.

Every error is an :class:`HFFormatError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from relax.models.config.families import FAMILIES
from relax.models.config.family_record import FamilyRecord
from relax.models.config.model import ModelConfig, RopeScaling
from relax.models.config.vision_language import VISION_LANGUAGE
from relax.models.hf.limits import SIZE_LIMITS, check_numbers, positive, size
from relax.models.hf.moe import moe_fields, moe_problems, moe_to_hf
from relax.models.hf.reader import ConfigReader, HFFormatError
from relax.models.hf.rope import ORIGINAL, gemma_rope, rope, rope_to_hf

_CAUSAL = {
    rec.causal_lm: name for name, rec in FAMILIES.items()
}  # causal-LM architecture -> family
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
}  # HF name -> relax
_HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_FIXED_TRAITS = ("norm_weight", "sandwich_norms", "qk_norm", "scale_embeddings")  # by model_type
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# transformers' defaults common to every family (a record's ``hf_defaults`` override them)
_COMMON_DEFAULTS = dict(
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=None
)


def _family(r: ConfigReader) -> FamilyRecord:
    """The record named by ``model_type`` and/or the causal-LM ``architectures`` (which must agree)."""
    supported = f"supported: model_type {list(FAMILIES)}, architectures {list(_CAUSAL)}"
    archs = r.d.get("architectures")
    mt = r.d.get("model_type")
    if mt in VISION_LANGUAGE or (
        isinstance(archs, list) and set(archs) & set(VISION_LANGUAGE.values())
    ):
        raise r.fail(
            "model_type",
            f"= {mt!r} ({archs}) is a vision-language model: load it with "
            "relax.models.vision.load_vision_language",
        )
    from_arch = set()
    if archs is not None:
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise r.fail("architectures", f"must be a list of strings, got {archs!r}")
        unknown = [a for a in archs if a not in _CAUSAL]
        if unknown:
            raise r.fail("architectures", f"= {unknown} is not supported; {supported}")
        from_arch = {_CAUSAL[a] for a in archs}
    if mt is not None:
        if mt not in FAMILIES:
            raise r.fail("model_type", f"= {mt!r} is not supported; {supported}")
        if from_arch and from_arch != {mt}:
            raise r.fail("architectures", f"= {archs} disagrees with model_type {mt!r}")
        return FAMILIES[mt]
    if len(from_arch) == 1:
        return FAMILIES[from_arch.pop()]
    raise r.fail(
        "model_type",
        f"is required (missing, and architectures={archs!r} does not decide it); {supported}",
    )


def _layer_types(r: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """``layer_types``, or (older configs) every ``sliding_window_pattern``-th layer full (default 6)."""
    layer_types = r.get("layer_types", None)
    if layer_types is None:
        n = r.int_("sliding_window_pattern", 6, lo=1)
        layer_types = [
            "sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)
        ]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(t not in _LAYER_TYPES for t in layer_types)
    ):
        raise r.fail(
            "layer_types",
            f"must list 'full_attention'/'sliding_attention' for each of "
            f"{num_layers} layers, got {layer_types!r}",
        )
    return tuple(_LAYER_TYPES[t] for t in layer_types)


def _refused(r: ConfigReader, rec: FamilyRecord) -> None:
    """Refuse the fields the record says relax does not run (e.g. Gemma's logit softcapping)."""
    for field, (allowed, tail) in rec.refused.items():
        if r.get(field, None) not in allowed:
            raise r.fail(field, tail.format(value=r.d[field]))


def _qwen_window(r: ConfigReader, rec: FamilyRecord, num_layers: int, max_pos: int) -> int | None:
    """Qwen2/Qwen3 sliding window: one window for every layer or none (mixed layers unsupported);
    without ``layer_types``, ``max_window_layers`` picks the sliding layers as ``rec.qwen_sliding`` says."""
    if not r.bool_("use_sliding_window", False):
        return None
    window = r.int_("sliding_window", 4096, nullable=True)
    if window is None:
        return None
    layer_types = r.get("layer_types", None)
    if layer_types is None:
        mwl = r.int_("max_window_layers", 28)
        slides = (
            (lambda i: i >= mwl)
            if rec.qwen_sliding == "from_max"
            else (lambda i: i % 2 == 0 and i < mwl)
        )
        layer_types = [
            "sliding_attention" if slides(i) else "full_attention" for i in range(num_layers)
        ]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(t not in ("full_attention", "sliding_attention") for t in layer_types)
    ):
        raise r.fail(
            "layer_types",
            f"must list 'full_attention'/'sliding_attention' for each of "
            f"{num_layers} layers, got {layer_types!r}",
        )
    n_sliding = layer_types.count("sliding_attention")
    if n_sliding == 0 or window >= max_pos:  # no sliding layer, or a window that masks nothing
        return None
    if n_sliding == num_layers:
        return window
    raise r.fail(
        "use_sliding_window",
        f"= true with sliding window {window} on {n_sliding} of "
        f"{num_layers} layers (max_window_layers / layer_types): mixed sliding and full "
        "attention layers are not supported",
    )


def _activation(r: ConfigReader, rec: FamilyRecord) -> str:
    field = rec.activation_field
    act = r.get(field, _HF_ACTIVATION[rec.activation])
    if act not in _ACTIVATIONS:
        raise r.fail(field, f"= {act!r} is not supported; supported: {list(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


def _biases(r: ConfigReader, rec: FamilyRecord) -> dict[str, bool]:
    """``qkv_bias`` / ``o_bias`` / ``mlp_bias`` as the record's ``biases`` / ``mlp_bias`` spell them."""
    attn = r.bool_("attention_bias", False) if rec.biases == "attention_bias" else False
    qkv = (
        r.bool_("qkv_bias", rec.hf_defaults["qkv_bias"])
        if rec.biases == "qkv_bias"
        else rec.biases == "qkv"
    )
    return dict(
        qkv_bias=attn or qkv,
        o_bias=attn,
        mlp_bias=r.bool_("mlp_bias", False) if rec.mlp_bias else False,
    )


def _family_fields(
    r: ConfigReader, rec: FamilyRecord, layers: int, max_pos: int, fd: dict
) -> dict[str, Any]:
    """The ModelConfig fields whose HF spelling differs by family: biases, windows, RoPE, scores."""
    _refused(r, rec)
    f: dict[str, Any] = dict(_biases(r, rec), sliding_window=None)
    if rec.window == "all":
        f["sliding_window"] = r.int_("sliding_window", fd.get("sliding_window"), nullable=True)
    elif rec.window == "qwen":
        f["sliding_window"] = _qwen_window(r, rec, layers, max_pos)
    elif rec.window == "flag" and r.bool_("use_sliding_window", False):
        f["sliding_window"] = r.int_("sliding_window", fd["sliding_window"], nullable=True)
    elif rec.window == "layer_types":
        f.update(
            sliding_window=r.int_("sliding_window", fd["sliding_window"], nullable=True),
            layer_types=_layer_types(r, layers),
        )
    if rec.local_rope:
        f["rope_theta"], f["rope_scaling"], f["rope_local_theta"] = gemma_rope(r, rec, max_pos, fd)
    else:
        f["rope_theta"], f["rope_scaling"] = rope(r, rec, max_pos, fd)
    if rec.query_pre_attn_scalar:
        f["query_pre_attn_scalar"] = r.float_("query_pre_attn_scalar", fd["query_pre_attn_scalar"])
    return {**f, **moe_fields(r, rec, layers)}


def _context(
    r: ConfigReader, file_max: int, scaling: RopeScaling | None, max_positions: int | None
) -> int:
    """The positions relax runs: the file's ``max_position_embeddings``, or ``max_positions`` (at
    most that); a LongRoPE model's must not exceed its original length (``RopeScaling``)."""
    if max_positions is not None and not 1 <= max_positions <= file_max:
        raise r.fail(
            "max_position_embeddings",
            f"= {file_max}: max_positions={max_positions} must be in [1, {file_max}]",
        )
    n = file_max if max_positions is None else max_positions
    if scaling is not None and scaling.kind == "longrope" and n > scaling.original_max_position:
        orig = scaling.original_max_position
        raise r.fail(
            "max_position_embeddings",
            (
                f"= {n} exceeds original_max_position_embeddings = {orig} with longrope RoPE: transformers uses "
                f"long_factor for sequences longer than {orig} tokens and short_factor for shorter ones (switching, "
                f"and recomputing its cache, as a sequence grows past {orig}), which relax's static RoPE tables "
                f"cannot follow. Load it with max_positions={orig} (load_pretrained(..., max_positions={orig})) "
                f"to run up to {orig} positions exactly as transformers does"
            ),
        )
    return n


def config_from_hf(d: dict, *, source: str, max_positions: int | None = None) -> ModelConfig:
    """:class:`ModelConfig` from a parsed Hugging Face ``config.json``; ``source`` names it in errors.

    ``max_positions`` caps the context relax runs (``max_position_embeddings``) below the file's;
    RoPE parameters derived from the file's (LongRoPE's factor) keep it.
    """
    r = ConfigReader(d, source)
    rec = _family(r)
    fd = {**_COMMON_DEFAULTS, **rec.hf_defaults}
    if r.d.get("quantization_config") is not None:
        raise r.fail("quantization_config", "is set: quantized checkpoints are not supported")
    act = _activation(r, rec)
    vocab, hidden, inter, layers, heads = (r.int_(k, lo=1, hi=SIZE_LIMITS[k]) for k in _REQUIRED)
    kv = size(r, "num_key_value_heads", fd["num_key_value_heads"])
    kv = heads if kv is None else kv
    if heads % kv:
        how = (
            ""
            if "num_key_value_heads" in r.d
            else f" (transformers' {rec.model_type} default when absent)"
        )
        raise r.fail("num_key_value_heads", f"= {kv}{how} must divide num_attention_heads={heads}")
    head_dim = size(r, "head_dim", fd["head_dim"])
    head_dim = hidden // heads if head_dim is None else head_dim
    max_pos = size(r, "max_position_embeddings", fd["max_position_embeddings"], nullable=False)
    fields = _family_fields(r, rec, layers, max_pos, fd)
    check_numbers(r, rec, fields)
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            family=rec.model_type,
            max_position_embeddings=_context(r, max_pos, fields["rope_scaling"], max_positions),
            rms_norm_eps=positive(r, "rms_norm_eps", r.float_("rms_norm_eps", fd["rms_norm_eps"])),
            tie_word_embeddings=r.bool_("tie_word_embeddings", fd["tie_word_embeddings"]),
            bos_token_id=r.token_ids("bos_token_id", fd["bos_token_id"]),
            eos_token_id=r.token_ids("eos_token_id", fd["eos_token_id"]),
            pad_token_id=r.token_ids("pad_token_id", fd["pad_token_id"]),
            activation=act,
            **{k: rec.traits[k] for k in _FIXED_TRAITS},
            **fields,
        )
    except HFFormatError:
        raise
    except ValueError as e:  # ModelConfig's own validation, e.g. heads not a multiple of kv heads
        raise HFFormatError(f"{source}: {e}") from None


def with_generation_config(cfg: ModelConfig, g: dict, *, source: str) -> ModelConfig:
    """``cfg`` with the stop tokens of a ``generation_config.json`` (what ``generate`` stops on;
    often more than ``config.json``'s, e.g. Llama 3's ``<|eot_id|>``), and its bos/pad where
    ``cfg`` has none."""
    r = ConfigReader(g, source)
    ids = {}
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = r.token_ids(field, None)
        if v is not None and (field == "eos_token_id" or getattr(cfg, field) is None):
            ids[field] = v
    return dataclasses.replace(cfg, **ids)


def generation_config_to_hf(cfg: ModelConfig) -> dict:
    ids = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "_from_model_config": True,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in ids.items() if v is not None},
    }


def dtype_name(dtype) -> str:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` for a jnp/np dtype or its name."""
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"dtype {name!r} is not a floating-point parameter dtype")
    return name


_OPTIONAL = {  # ModelConfig field -> whether a family's config has it (required there, refused elsewhere)
    "layer_types": lambda rec: rec.window == "layer_types",
    "rope_local_theta": lambda rec: rec.local_rope,
    "query_pre_attn_scalar": lambda rec: rec.query_pre_attn_scalar,
}


def _check_expressible(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` listing what of ``cfg`` its family's ``config.json`` cannot say (its
    fixed traits, bias, window and RoPE spellings)."""
    rec = FAMILIES[cfg.family]
    fam = rec.model_type
    bad = [
        f"{k}={getattr(cfg, k)!r} ({fam} has {v!r})"
        for k, v in rec.traits.items()
        if k in _FIXED_TRAITS and getattr(cfg, k) != v
    ]
    if rec.biases == "attention_bias" and cfg.qkv_bias != cfg.o_bias:
        bad.append(
            f"qkv_bias={cfg.qkv_bias} with o_bias={cfg.o_bias} ({fam} has one attention_bias)"
        )
    if rec.biases == "qkv" and (not cfg.qkv_bias or cfg.o_bias):
        bad.append(f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} ({fam} is always True, False)")
    if rec.biases == "qkv_bias" and cfg.o_bias:
        bad.append(f"o_bias=True ({fam} has none)")
    if rec.biases == "none" and (cfg.qkv_bias or cfg.o_bias):
        bad.append("attention biases")
    if not rec.mlp_bias and cfg.mlp_bias:
        bad.append("mlp_bias=True")
    if rec.window == "none" and cfg.sliding_window is not None:
        bad.append(f"sliding_window={cfg.sliding_window}")
    for field, has in _OPTIONAL.items():
        if (getattr(cfg, field) is None) == has(rec):
            only = ", ".join(n for n, r in FAMILIES.items() if has(r)) + " only"
            bad.append(f"{field}={getattr(cfg, field)!r} ({'required' if has(rec) else only})")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind not in rec.rope_types:
        bad.append(
            f"rope_scaling kind {cfg.rope_scaling.kind!r} ({fam} has {list(rec.rope_types)})"
        )
    bad += moe_problems(cfg, rec)
    if bad:
        raise ValueError(
            f"ModelConfig(family={fam!r}) cannot be written as a Hugging Face "
            f"{rec.causal_lm}: {'; '.join(bad)}"
        )


def _family_to_hf(cfg: ModelConfig, rec: FamilyRecord, params: dict) -> dict[str, Any]:
    """The fields whose HF spelling differs by family (``_family_fields`` read back)."""
    d, w = dict(rec.hf_extra), cfg.sliding_window
    if rec.biases in ("attention_bias", "qkv_bias"):
        d[rec.biases] = cfg.qkv_bias
    if rec.mlp_bias:
        d["mlp_bias"] = cfg.mlp_bias
    if rec.window == "all":
        d["sliding_window"] = w
    elif rec.window == "flag":
        d.update(use_sliding_window=w is not None, sliding_window=w)
    elif rec.window == "qwen":
        d.update(
            use_sliding_window=w is not None,
            sliding_window=w,
            max_window_layers=0 if w is not None else cfg.num_layers,
            layer_types=["sliding_attention" if w is not None else "full_attention"]
            * cfg.num_layers,
        )
    elif rec.window == "layer_types":
        hf_types = {v: k for k, v in _LAYER_TYPES.items()}
        d.update(sliding_window=w, layer_types=[hf_types[t] for t in cfg.layer_types])
    if rec.local_rope:
        d.update(
            rope_local_base_freq=cfg.rope_local_theta,
            rope_parameters={
                "full_attention": params,
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
            },
        )
    if rec.query_pre_attn_scalar:
        qpas = cfg.query_pre_attn_scalar
        d["query_pre_attn_scalar"] = int(qpas) if float(qpas).is_integer() else qpas
    if ORIGINAL in rec.hf_defaults and cfg.rope_scaling is not None:  # a top-level field wins there
        d[ORIGINAL] = cfg.rope_scaling.original_max_position
    return {**d, **moe_to_hf(cfg, rec)}


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x both load as the same model.

    Writes the 4.x fields (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the 5.x ones
    (``rope_parameters``, ``dtype``) with the same values. ``dtype`` is the parameters' dtype.
    Gemma 3's per-layer kinds are written as ``layer_types`` (transformers >= 4.53).
    """
    _check_expressible(cfg)
    rec = FAMILIES[cfg.family]
    name = dtype_name(dtype)
    scaling, params = rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    d: dict[str, Any] = {
        "architectures": [rec.causal_lm],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        rec.activation_field: _HF_ACTIVATION[cfg.activation],
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": params,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": name,
        "dtype": name,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    d.update(_family_to_hf(cfg, rec, params))
    return d
