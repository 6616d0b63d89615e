"""The RoPE fields of a Hugging Face ``config.json``, both ways.

Reading: ``rope_theta`` and the :class:`RopeScaling` from the 4.x (``rope_scaling`` with
``rope_type`` or the older ``type``, top-level ``rope_theta``) and 5.x (``rope_parameters``)
layouts with transformers' precedence, Phi-3's LongRoPE and Gemma 3's separate local theta.
Writing: the 4.x ``rope_scaling`` and 5.x ``rope_parameters`` of one RoPE.
"""

from __future__ import annotations

import math

from relax.models.config.family_record import FamilyRecord
from relax.models.config.model import RopeScaling
from relax.models.hf.reader import ABSENT, ConfigReader

ORIGINAL = "original_max_position_embeddings"
"""The field naming the context a scaled RoPE (llama3, LongRoPE) was trained at."""


def rope(
    r: ConfigReader, rec: FamilyRecord, max_pos: int, fd: dict
) -> tuple[float, RopeScaling | None]:
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
            raise r.fail(
                field, f"has different RoPE parameters per layer type ({nested}); unsupported"
            )
        p, field = values[0], f"{field}.{nested[0]}"
    return _rope_params(r, rec, p, field, max_pos, fd)


def _original_max(r: ConfigReader, p: dict, prefix: str, max_pos: int, fd: dict) -> int:
    """``original_max_position_embeddings`` as transformers resolves it: a top-level value wins (a
    family whose config class has the field, Phi-3, always uses its own, default included), then
    the RoPE parameters' own, then ``max_position_embeddings``."""
    if ORIGINAL in r.d or ORIGINAL in fd:
        return r.int_(ORIGINAL, fd.get(ORIGINAL, ABSENT))
    return r.int_(ORIGINAL, max_pos, d=p, prefix=prefix)


def _factor_list(r: ConfigReader, p: dict, name: str, prefix: str) -> tuple[float, ...]:
    """LongRoPE's ``short_factor`` / ``long_factor`` list (its length ModelConfig checks)."""
    v = r.get(name, d=p, prefix=prefix)
    if not isinstance(v, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
    ):
        raise r.fail(prefix + name, f"must be a list of numbers, got {v!r}")
    return tuple(float(x) for x in v)


def _longrope(r: ConfigReader, p: dict, prefix: str, max_pos: int, fd: dict) -> RopeScaling:
    """Phi-3's LongRoPE as ``_compute_longrope_parameters`` builds it: ``factor`` (else
    ``max_position_embeddings / original``) and ``attention_factor`` (else
    ``sqrt(1 + ln(factor) / ln(original))``, 1 for a factor <= 1)."""
    orig = _original_max(r, p, prefix, max_pos, fd)
    factor = r.float_("factor", max_pos / orig, d=p, prefix=prefix)
    default_af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    af = r.get("attention_factor", None, d=p)
    af = default_af if af is None else r.float_("attention_factor", d=p, prefix=prefix)
    return RopeScaling(
        "longrope",
        factor,
        original_max_position=orig,
        attention_factor=af,
        short_factor=_factor_list(r, p, "short_factor", prefix),
        long_factor=_factor_list(r, p, "long_factor", prefix),
    )


def _rope_params(
    r: ConfigReader, rec: FamilyRecord, p: dict, field: str, max_pos: int, fd: dict
) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of one RoPE parameter object ``p`` (named ``field`` in errors); a
    theta it lacks is the top-level ``rope_theta``, else the family's default."""
    d, pre = r.d, field + "."
    if "rope_theta" in p:
        theta = r.float_("rope_theta", d=p, prefix=pre)
    elif d.get("rope_theta") is not None:
        theta = r.float_("rope_theta")
    else:
        theta = fd["rope_theta"]
    prf = p.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and prf != 1.0:
        raise r.fail(
            "partial_rotary_factor",
            f"= {prf!r} is not supported (only 1.0: relax rotates whole heads)",
        )
    kind = p.get("rope_type", p.get("type", "default"))
    kind = rec.rope_aliases.get(kind, kind)
    kind_field = f"{field}.{'rope_type' if 'rope_type' in p else 'type'}"
    if kind not in rec.rope_types:
        raise r.fail(
            kind_field,
            f"= {kind!r}: RoPE scaling type not supported for {rec.model_type}; "
            f"supported: {list(rec.rope_types)}",
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", r.float_("factor", d=p, prefix=pre))
    if kind == "longrope":
        return theta, _longrope(r, p, pre, max_pos, fd)
    f = lambda k: r.float_(k, d=p, prefix=pre)  # llama3
    orig = _original_max(r, p, pre, max_pos, fd)
    return theta, RopeScaling(
        "llama3", f("factor"), f("low_freq_factor"), f("high_freq_factor"), orig
    )


def gemma_rope(
    r: ConfigReader, rec: FamilyRecord, max_pos: int, fd: dict
) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling, rope_local_theta) as ``Gemma3TextConfig`` builds them: the
    ``rope_parameters`` entries ``full_attention`` / ``sliding_attention`` (5.x), the first
    updated by a top-level ``rope_scaling`` (4.x); a theta they lack is the top-level
    ``rope_theta`` / ``rope_local_base_freq``, else 1e6 / 1e4. The sliding layers' RoPE is unscaled."""
    rp = r.get("rope_parameters", None) or {}
    if not isinstance(rp, dict) or any(
        k not in ("full_attention", "sliding_attention") for k in rp
    ):
        raise r.fail(
            "rope_parameters",
            "must be null or an object of 'full_attention' / 'sliding_attention' "
            f"RoPE parameters, got {rp!r}",
        )
    full, field = dict(rp.get("full_attention") or {}), "rope_parameters.full_attention"
    scaling = r.get("rope_scaling", None)
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise r.fail("rope_scaling", f"must be an object or null, got {scaling!r}")
        full, field = {**full, **scaling}, "rope_scaling"
    theta, scaling = _rope_params(r, rec, full, field, max_pos, fd)
    local = rp.get("sliding_attention") or {}
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise r.fail(
            "rope_parameters.sliding_attention.rope_type",
            f"= {local_kind!r}: the sliding layers' RoPE must be 'default' (unscaled)",
        )
    if "rope_theta" in local:
        return (
            theta,
            scaling,
            r.float_("rope_theta", d=local, prefix="rope_parameters.sliding_attention."),
        )
    return theta, scaling, r.float_("rope_local_base_freq", fd["rope_local_theta"])


def rope_to_hf(theta: float, s: RopeScaling | None) -> tuple[dict | None, dict]:
    """(4.x ``rope_scaling``, 5.x ``rope_parameters``) of one RoPE."""
    if s is None:
        return None, {"rope_type": "default", "rope_theta": theta}
    if s.kind == "linear":
        scaling = {"rope_type": "linear", "factor": s.factor}
    elif (
        s.kind == "longrope"
    ):  # factor and attention_factor explicit: they do not hang on max_position_embeddings
        scaling = {
            "rope_type": "longrope",
            "factor": s.factor,
            "attention_factor": s.attention_factor,
            "short_factor": list(s.short_factor),
            "long_factor": list(s.long_factor),
            ORIGINAL: s.original_max_position,
        }
    else:
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            ORIGINAL: s.original_max_position,
        }
    return scaling, {**scaling, "rope_theta": theta}
