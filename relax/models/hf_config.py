"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

Reads both layouts found on the hub (DESIGN.md §4b): transformers 4.x (top-level
``rope_theta``, ``rope_scaling`` with ``rope_type`` or the older ``type``, ``torch_dtype``) and
5.x (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields, ``dtype``).
A field a file leaves out takes the default transformers 5.23 gives it for that family, so
relax builds the model transformers would build (e.g. an absent ``num_key_value_heads`` is 8 for
Mistral and 32 for Qwen2/Qwen3; an absent ``head_dim`` is 128 for Qwen3). An explicit
``null`` ``head_dim`` / ``num_key_value_heads`` means ``hidden/heads`` / ``num_attention_heads``.

Every error is an :class:`HFFormatError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from relax.models.config import FAMILIES, ModelConfig, RopeScaling


class HFFormatError(ValueError):
    """A Hugging Face checkpoint relax cannot read; the message names the file and the field or tensor."""


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ARCH_FAMILY = {a: f for f, a in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu", "swish")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ABSENT = object()

# transformers 5.23 dataclass defaults (configuration_<family>.py) for the fields we read.
# None for num_key_value_heads / head_dim means "num_attention_heads" / "hidden // heads".
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2),
    "mistral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=4096 * 32,
                    bos_token_id=1, eos_token_id=2, sliding_window=4096),
    "qwen2": dict(num_key_value_heads=32, head_dim=None, max_position_embeddings=32768,
                  bos_token_id=None, eos_token_id=None),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  bos_token_id=None, eos_token_id=None),
}
_COMMON_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                        pad_token_id=None, hidden_act="silu")


class _Reader:
    """Typed access to one config dict; errors name ``source`` and the field."""

    def __init__(self, d: dict, source: str):
        if not isinstance(d, dict):
            raise HFFormatError(f"{source}: expected a JSON object, got {type(d).__name__}")
        self.d, self.source = d, source

    def fail(self, field: str, msg: str) -> HFFormatError:
        return HFFormatError(f"{self.source}: field {field!r} {msg}")

    def get(self, field: str, default: Any = _ABSENT, d: dict | None = None, prefix: str = "") -> Any:
        d = self.d if d is None else d
        if field in d:
            return d[field]
        if default is _ABSENT:
            raise self.fail(prefix + field, "is required but missing")
        return default

    def int_(self, field, default=_ABSENT, *, nullable=False, d=None, prefix=""):
        v = self.get(field, default, d, prefix)
        if v is None and nullable:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(prefix + field, f"must be an integer, got {v!r}")
        return v

    def float_(self, field, default=_ABSENT, *, d=None, prefix=""):
        v = self.get(field, default, d, prefix)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self.fail(prefix + field, f"must be a number, got {v!r}")
        return float(v)

    def bool_(self, field, default=_ABSENT):
        v = self.get(field, default)
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, got {v!r}")
        return v

    def token_ids(self, field, default):
        v = self.get(field, default)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v[0] if len(v) == 1 else tuple(v)
        raise self.fail(field, f"must be an integer, a list of integers or null, got {v!r}")


def _family(r: _Reader) -> str:
    supported = f"supported: model_type {list(FAMILIES)}, architectures {list(_ARCH_FAMILY)}"
    archs = r.d.get("architectures")
    from_arch = set()
    if archs is not None:
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise r.fail("architectures", f"must be a list of strings, got {archs!r}")
        unknown = [a for a in archs if a not in _ARCH_FAMILY]
        if unknown:
            raise r.fail("architectures", f"= {unknown} is not supported; {supported}")
        from_arch = {_ARCH_FAMILY[a] for a in archs}
    mt = r.d.get("model_type")
    if mt is not None:
        if mt not in FAMILIES:
            raise r.fail("model_type", f"= {mt!r} is not supported; {supported}")
        if from_arch and from_arch != {mt}:
            raise r.fail("architectures", f"= {archs} disagrees with model_type {mt!r}")
        return mt
    if len(from_arch) == 1:
        return from_arch.pop()
    raise r.fail("model_type", f"is required (missing, and architectures={archs!r} does not decide it); {supported}")


def _rope(r: _Reader, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) with transformers' precedence: rope_scaling, then rope_parameters."""
    d = r.d
    field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    p = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(p, dict):
        raise r.fail(field, f"must be an object or null, got {p!r}")
    nested = [k for k in ("full_attention", "sliding_attention") if isinstance(p.get(k), dict)]
    if nested:  # 5.x per-layer-type rope parameters: supported when every layer type agrees
        values = [p[k] for k in nested]
        if any(v != values[0] for v in values):
            raise r.fail(field, f"has different RoPE parameters per layer type ({nested}); unsupported")
        p, field = values[0], f"{field}.{nested[0]}"
    if "rope_theta" in p:
        theta = r.float_("rope_theta", d=p, prefix=field + ".")
    elif d.get("rope_theta") is not None:
        theta = r.float_("rope_theta")
    else:
        theta = _COMMON_DEFAULTS["rope_theta"]
    prf = p.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and prf != 1.0:
        raise r.fail("partial_rotary_factor", f"= {prf!r} is not supported (only 1.0)")
    kind = p.get("rope_type", p.get("type", "default"))
    kind_field = f"{field}.{'rope_type' if 'rope_type' in p else 'type'}"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", r.float_("factor", d=p, prefix=field + "."))
    if kind == "llama3":
        f = lambda k: r.float_(k, d=p, prefix=field + ".")
        if "original_max_position_embeddings" in d:  # a top-level value wins, as in transformers
            orig = r.int_("original_max_position_embeddings")
        else:
            orig = r.int_("original_max_position_embeddings", max_pos, d=p, prefix=field + ".")
        return theta, RopeScaling("llama3", f("factor"), f("low_freq_factor"), f("high_freq_factor"), orig)
    raise r.fail(kind_field, f"= {kind!r}: RoPE scaling type not supported; supported: {list(ROPE_TYPES)}")


def _qwen_window(r: _Reader, num_layers: int, max_pos: int) -> int | None:
    """Qwen2/Qwen3 sliding window: one window for every layer or none (mixed layers unsupported)."""
    if not r.bool_("use_sliding_window", False):
        return None
    window = r.int_("sliding_window", 4096, nullable=True)
    if window is None:
        return None
    layer_types = r.get("layer_types", None)
    if layer_types is None:
        mwl = r.int_("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in ("full_attention", "sliding_attention") for t in layer_types)):
        raise r.fail("layer_types", f"must list 'full_attention'/'sliding_attention' for each of "
                                    f"{num_layers} layers, got {layer_types!r}")
    n_sliding = layer_types.count("sliding_attention")
    if n_sliding == 0 or window >= max_pos:  # no sliding layer, or a window that masks nothing
        return None
    if n_sliding == num_layers:
        return window
    raise r.fail("use_sliding_window", f"= true with sliding window {window} on {n_sliding} of "
                 f"{num_layers} layers (max_window_layers / layer_types): mixed sliding and full "
                 "attention layers are not supported")


def config_from_hf(d: dict, *, source: str) -> ModelConfig:
    """:class:`ModelConfig` from a parsed Hugging Face ``config.json``; ``source`` names it in errors."""
    r = _Reader(d, source)
    family = _family(r)
    fd = {**_COMMON_DEFAULTS, **_FAMILY_DEFAULTS[family]}
    if r.d.get("quantization_config") is not None:
        raise r.fail("quantization_config", "is set: quantized checkpoints are not supported")
    act = r.get("hidden_act", fd["hidden_act"])
    if act not in _ACTIVATIONS:
        raise r.fail("hidden_act", f"= {act!r} is not supported; supported: {list(_ACTIVATIONS)}")
    vocab, hidden, inter, layers, heads = (r.int_(k) for k in _REQUIRED)
    if heads < 1:
        raise r.fail("num_attention_heads", f"must be >= 1, got {heads}")
    kv = r.int_("num_key_value_heads", fd["num_key_value_heads"], nullable=True)
    kv = heads if kv is None else kv
    if kv < 1 or heads % kv:
        how = "" if "num_key_value_heads" in r.d else f" (transformers' {family} default when absent)"
        raise r.fail("num_key_value_heads", f"= {kv}{how} must divide num_attention_heads={heads}")
    head_dim = r.int_("head_dim", fd["head_dim"], nullable=True)
    head_dim = hidden // heads if head_dim is None else head_dim
    max_pos = r.int_("max_position_embeddings", fd["max_position_embeddings"])
    theta, scaling = _rope(r, max_pos)
    qkv_bias = o_bias = mlp_bias = qk_norm = False
    window = None
    if family == "llama":
        qkv_bias = o_bias = r.bool_("attention_bias", False)
        mlp_bias = r.bool_("mlp_bias", False)
    elif family == "mistral":
        window = r.int_("sliding_window", fd["sliding_window"], nullable=True)
    elif family == "qwen2":
        qkv_bias = True
        window = _qwen_window(r, layers, max_pos)
    else:  # qwen3
        qkv_bias = o_bias = r.bool_("attention_bias", False)
        qk_norm = True
        window = _qwen_window(r, layers, max_pos)
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, family=family,
            max_position_embeddings=max_pos, rms_norm_eps=r.float_("rms_norm_eps", fd["rms_norm_eps"]),
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=r.bool_("tie_word_embeddings", fd["tie_word_embeddings"]),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, sliding_window=window,
            bos_token_id=r.token_ids("bos_token_id", fd["bos_token_id"]),
            eos_token_id=r.token_ids("eos_token_id", fd["eos_token_id"]),
            pad_token_id=r.token_ids("pad_token_id", fd["pad_token_id"]))
    except HFFormatError:
        raise
    except ValueError as e:  # ModelConfig's own validation, e.g. heads not a multiple of kv heads
        raise HFFormatError(f"{source}: {e}") from None


def with_generation_config(cfg: ModelConfig, g: dict, *, source: str) -> ModelConfig:
    """``cfg`` with the stop tokens of a ``generation_config.json`` (what ``generate`` stops on;
    often more than ``config.json``'s, e.g. Llama 3's ``<|eot_id|>``), and its bos/pad where
    ``cfg`` has none."""
    r = _Reader(g, source)
    ids = {}
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = r.token_ids(field, None)
        if v is not None and (field == "eos_token_id" or getattr(cfg, field) is None):
            ids[field] = v
    return dataclasses.replace(cfg, **ids)


def generation_config_to_hf(cfg: ModelConfig) -> dict:
    ids = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"_from_model_config": True,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in ids.items() if v is not None}}


def dtype_name(dtype) -> str:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` for a jnp/np dtype or its name."""
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"dtype {name!r} is not a floating-point parameter dtype")
    return name


def _check_expressible(cfg: ModelConfig) -> None:
    fam = cfg.family
    bad = []
    if fam in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        bad.append(f"qkv_bias={cfg.qkv_bias} with o_bias={cfg.o_bias} ({fam} has one attention_bias)")
    if fam != "llama" and cfg.mlp_bias:
        bad.append("mlp_bias=True")
    if fam == "llama" and cfg.sliding_window is not None:
        bad.append(f"sliding_window={cfg.sliding_window}")
    if fam == "mistral" and (cfg.qkv_bias or cfg.o_bias):
        bad.append("attention biases")
    if fam == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
        bad.append(f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} (qwen2 is always True, False)")
    if (fam == "qwen3") != cfg.qk_norm:
        bad.append(f"qk_norm={cfg.qk_norm}")
    if bad:
        raise ValueError(f"ModelConfig(family={fam!r}) cannot be written as a Hugging Face "
                         f"{ARCHITECTURES[fam]}: {'; '.join(bad)}")


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x both load as the same model.

    Writes the 4.x fields (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the 5.x ones
    (``rope_parameters``, ``dtype``) with the same values. ``dtype`` is the parameters' dtype.
    """
    _check_expressible(cfg)
    name = dtype_name(dtype)
    s = cfg.rope_scaling
    if s is None:
        scaling, params = None, {"rope_type": "default", "rope_theta": cfg.rope_theta}
    elif s.kind == "linear":
        scaling = {"rope_type": "linear", "factor": s.factor}
        params = {**scaling, "rope_theta": cfg.rope_theta}
    else:
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position}
        params = {**scaling, "rope_theta": cfg.rope_theta}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos, "pad_token_id": cfg.pad_token_id, "torch_dtype": name, "dtype": name,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if cfg.family == "llama":
        d.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    elif cfg.family == "mistral":
        d.update(sliding_window=cfg.sliding_window)
    else:
        w = cfg.sliding_window
        d.update(use_sliding_window=w is not None, sliding_window=w,
                 max_window_layers=0 if w is not None else cfg.num_layers,
                 layer_types=["sliding_attention" if w is not None else "full_attention"] * cfg.num_layers)
        if cfg.family == "qwen3":
            d.update(attention_bias=cfg.qkv_bias)
    return d
