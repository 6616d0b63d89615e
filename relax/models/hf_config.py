"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

A family's fixed traits (``relax.models.config.FAMILY_TRAITS``: norm style, sandwich and q/k
norms, embedding scale) come from its ``model_type``; everything else from the file's fields.

Reads both layouts found on the hub: transformers 4.x (top-level
``rope_theta``, ``rope_scaling`` with ``rope_type`` or the older ``type``, ``torch_dtype``) and
5.x (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields, ``dtype``).
A field a file leaves out takes the default transformers 5.23 gives it for that family, so
relax builds the model transformers would build (e.g. an absent ``num_key_value_heads`` is 8 for
Mistral and 32 for Qwen2/Qwen3; an absent ``head_dim`` is 128 for Qwen3 and 256 for Gemma 3,
whose absent ``layer_types`` follow ``sliding_window_pattern``, default 6). An explicit
``null`` ``head_dim`` / ``num_key_value_heads`` means ``hidden/heads`` / ``num_attention_heads``.

Every error is an :class:`HFFormatError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from relax.models.config import FAMILIES, FAMILY_TRAITS, ModelConfig, RopeScaling


class HFFormatError(ValueError):
    """A Hugging Face checkpoint relax cannot read; the message names the file and the field or tensor."""


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_ARCH_FAMILY = {a: f for f, a in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> relax
_HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
_ACTIVATION_FIELD = {"gemma3_text": "hidden_activation"}  # else "hidden_act"
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_FIXED_TRAITS = ("norm_weight", "sandwich_norms", "qk_norm", "scale_embeddings")  # by model_type
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
    "gemma3_text": dict(num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                        hidden_act="gelu_pytorch_tanh", sliding_window=4096, query_pre_attn_scalar=256,
                        rope_theta=1_000_000.0, rope_local_theta=10_000.0),
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
    return _rope_params(r, p, field, _COMMON_DEFAULTS["rope_theta"], max_pos)


def _rope_params(r: _Reader, p: dict, field: str, default_theta: float, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of one RoPE parameter object ``p`` (named ``field`` in errors); a
    theta it lacks is the top-level ``rope_theta``, else ``default_theta``."""
    d = r.d
    if "rope_theta" in p:
        theta = r.float_("rope_theta", d=p, prefix=field + ".")
    elif d.get("rope_theta") is not None:
        theta = r.float_("rope_theta")
    else:
        theta = default_theta
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


def _gemma_rope(r: _Reader, max_pos: int, fd: dict) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling, rope_local_theta) as ``Gemma3TextConfig`` builds them: the
    ``rope_parameters`` entries ``full_attention`` / ``sliding_attention`` (5.x), the first
    updated by a top-level ``rope_scaling`` (4.x); a theta they lack is the top-level
    ``rope_theta`` / ``rope_local_base_freq``, else 1e6 / 1e4. The sliding layers' RoPE is unscaled."""
    rp = r.get("rope_parameters", None) or {}
    if not isinstance(rp, dict) or any(k not in ("full_attention", "sliding_attention") for k in rp):
        raise r.fail("rope_parameters", "must be null or an object of 'full_attention' / 'sliding_attention' "
                     f"RoPE parameters, got {rp!r}")
    full, field = dict(rp.get("full_attention") or {}), "rope_parameters.full_attention"
    scaling = r.get("rope_scaling", None)
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise r.fail("rope_scaling", f"must be an object or null, got {scaling!r}")
        full, field = {**full, **scaling}, "rope_scaling"
    theta, scaling = _rope_params(r, full, field, fd["rope_theta"], max_pos)
    local = rp.get("sliding_attention") or {}
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise r.fail("rope_parameters.sliding_attention.rope_type",
                     f"= {local_kind!r}: the sliding layers' RoPE must be 'default' (unscaled)")
    if "rope_theta" in local:
        return theta, scaling, r.float_("rope_theta", d=local, prefix="rope_parameters.sliding_attention.")
    return theta, scaling, r.float_("rope_local_base_freq", fd["rope_local_theta"])


def _gemma_layer_types(r: _Reader, num_layers: int) -> tuple[str, ...]:
    """``layer_types``, or (older configs) every ``sliding_window_pattern``-th layer full (default 6)."""
    layer_types = r.get("layer_types", None)
    if layer_types is None:
        n = r.int_("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in _LAYER_TYPES for t in layer_types)):
        raise r.fail("layer_types", f"must list 'full_attention'/'sliding_attention' for each of "
                                    f"{num_layers} layers, got {layer_types!r}")
    return tuple(_LAYER_TYPES[t] for t in layer_types)


def _gemma_unsupported(r: _Reader) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if r.get(field, None) is not None:
            raise r.fail(field, f"= {r.d[field]!r}: logit softcapping is not supported (Gemma 3 has none: null)")
    if r.get("use_bidirectional_attention", None) not in (None, False):
        raise r.fail("use_bidirectional_attention", "= true is not supported (causal attention only)")


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


def _activation(r: _Reader, family: str, fd: dict) -> str:
    field = _ACTIVATION_FIELD.get(family, "hidden_act")
    act = r.get(field, fd["hidden_act"])
    if act not in _ACTIVATIONS:
        raise r.fail(field, f"= {act!r} is not supported; supported: {list(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


def _family_fields(r: _Reader, family: str, layers: int, max_pos: int, fd: dict) -> dict[str, Any]:
    """The ModelConfig fields whose HF spelling differs by family: biases, windows, RoPE, and Gemma's."""
    f: dict[str, Any] = dict(qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None)
    if family != "gemma3_text":
        f["rope_theta"], f["rope_scaling"] = _rope(r, max_pos)
    if family == "llama":
        f.update(qkv_bias=r.bool_("attention_bias", False), o_bias=r.bool_("attention_bias", False),
                 mlp_bias=r.bool_("mlp_bias", False))
    elif family == "mistral":
        f["sliding_window"] = r.int_("sliding_window", fd["sliding_window"], nullable=True)
    elif family == "qwen2":
        f.update(qkv_bias=True, sliding_window=_qwen_window(r, layers, max_pos))
    elif family == "qwen3":
        bias = r.bool_("attention_bias", False)
        f.update(qkv_bias=bias, o_bias=bias, sliding_window=_qwen_window(r, layers, max_pos))
    else:  # gemma3_text
        _gemma_unsupported(r)
        bias = r.bool_("attention_bias", False)
        theta, scaling, local = _gemma_rope(r, max_pos, fd)
        f.update(qkv_bias=bias, o_bias=bias, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local,
                 sliding_window=r.int_("sliding_window", fd["sliding_window"], nullable=True),
                 layer_types=_gemma_layer_types(r, layers),
                 query_pre_attn_scalar=r.float_("query_pre_attn_scalar", fd["query_pre_attn_scalar"]))
    return f


def config_from_hf(d: dict, *, source: str) -> ModelConfig:
    """:class:`ModelConfig` from a parsed Hugging Face ``config.json``; ``source`` names it in errors."""
    r = _Reader(d, source)
    family = _family(r)
    fd = {**_COMMON_DEFAULTS, **_FAMILY_DEFAULTS[family]}
    if r.d.get("quantization_config") is not None:
        raise r.fail("quantization_config", "is set: quantized checkpoints are not supported")
    act = _activation(r, family, fd)
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
    traits = {k: FAMILY_TRAITS[family][k] for k in _FIXED_TRAITS}
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, family=family,
            max_position_embeddings=max_pos, rms_norm_eps=r.float_("rms_norm_eps", fd["rms_norm_eps"]),
            tie_word_embeddings=r.bool_("tie_word_embeddings", fd["tie_word_embeddings"]),
            bos_token_id=r.token_ids("bos_token_id", fd["bos_token_id"]),
            eos_token_id=r.token_ids("eos_token_id", fd["eos_token_id"]),
            pad_token_id=r.token_ids("pad_token_id", fd["pad_token_id"]),
            activation=act, **traits, **_family_fields(r, family, layers, max_pos, fd))
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
    bad = [f"{k}={getattr(cfg, k)!r} ({fam} has {v!r})" for k, v in FAMILY_TRAITS[fam].items()
           if k in _FIXED_TRAITS and getattr(cfg, k) != v]
    if fam in ("llama", "qwen3", "gemma3_text") and cfg.qkv_bias != cfg.o_bias:
        bad.append(f"qkv_bias={cfg.qkv_bias} with o_bias={cfg.o_bias} ({fam} has one attention_bias)")
    if fam != "llama" and cfg.mlp_bias:
        bad.append("mlp_bias=True")
    if fam == "llama" and cfg.sliding_window is not None:
        bad.append(f"sliding_window={cfg.sliding_window}")
    if fam == "mistral" and (cfg.qkv_bias or cfg.o_bias):
        bad.append("attention biases")
    if fam == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
        bad.append(f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} (qwen2 is always True, False)")
    gemma = fam == "gemma3_text"
    for field in ("layer_types", "rope_local_theta", "query_pre_attn_scalar"):
        if (getattr(cfg, field) is None) == gemma:
            bad.append(f"{field}={getattr(cfg, field)!r} ({'required' if gemma else 'gemma3_text only'})")
    if bad:
        raise ValueError(f"ModelConfig(family={fam!r}) cannot be written as a Hugging Face "
                         f"{ARCHITECTURES[fam]}: {'; '.join(bad)}")


def _rope_to_hf(theta: float, s: RopeScaling | None) -> tuple[dict | None, dict]:
    """(4.x ``rope_scaling``, 5.x ``rope_parameters``) of one RoPE."""
    if s is None:
        return None, {"rope_type": "default", "rope_theta": theta}
    if s.kind == "linear":
        scaling = {"rope_type": "linear", "factor": s.factor}
    else:
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    return scaling, {**scaling, "rope_theta": theta}


def _family_to_hf(cfg: ModelConfig, params: dict) -> dict[str, Any]:
    """The fields whose HF spelling differs by family (``_family_fields`` read back)."""
    w = cfg.sliding_window
    if cfg.family == "llama":
        return dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    if cfg.family == "mistral":
        return dict(sliding_window=w)
    if cfg.family in ("qwen2", "qwen3"):
        d = dict(use_sliding_window=w is not None, sliding_window=w,
                 max_window_layers=0 if w is not None else cfg.num_layers,
                 layer_types=["sliding_attention" if w is not None else "full_attention"] * cfg.num_layers)
        return {**d, "attention_bias": cfg.qkv_bias} if cfg.family == "qwen3" else d
    hf_types = {v: k for k, v in _LAYER_TYPES.items()}
    qpas = cfg.query_pre_attn_scalar
    return dict(  # gemma3_text
        attention_bias=cfg.qkv_bias, sliding_window=w, layer_types=[hf_types[t] for t in cfg.layer_types],
        query_pre_attn_scalar=int(qpas) if float(qpas).is_integer() else qpas,
        rope_local_base_freq=cfg.rope_local_theta,
        rope_parameters={"full_attention": params,
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        attn_logit_softcapping=None, final_logit_softcapping=None, use_bidirectional_attention=False)


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x both load as the same model.

    Writes the 4.x fields (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the 5.x ones
    (``rope_parameters``, ``dtype``) with the same values. ``dtype`` is the parameters' dtype.
    Gemma 3's per-layer kinds are written as ``layer_types`` (transformers >= 4.53).
    """
    _check_expressible(cfg)
    name = dtype_name(dtype)
    scaling, params = _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, _ACTIVATION_FIELD.get(cfg.family, "hidden_act"): _HF_ACTIVATION[cfg.activation],
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos, "pad_token_id": cfg.pad_token_id, "torch_dtype": name, "dtype": name,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    d.update(_family_to_hf(cfg, params))
    return d
