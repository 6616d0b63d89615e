"""What a ``config.json`` may say, checked from the file alone (``relax.models.hf.config`` reads
through these): every size in ``[1, SIZE_LIMITS[field]]``, and the numbers that relax's float32
tables use (RoPE thetas and factors, ``rms_norm_eps``) positive and within float32's range, so
that no config can stall a load with per-layer work or load a model whose every output is NaN.
Errors are :class:`HFFormatError` naming the file and the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax.models.config.family_record import FamilyRecord
from relax.models.config.model import RopeScaling
from relax.models.hf.reader import ConfigReader
from relax.models.hf.rope import ORIGINAL

__all__ = ["SIZE_LIMITS", "check_numbers", "positive", "size"]

# The most each size may be: far past every released model (the deepest has ~130 layers, the
# largest vocabulary ~260k, the longest context ~10M positions), small enough that what is read
# per layer cannot stall a load; 2**24 positions: float32 RoPE angles (relax.models.layers.rope)
# tell integer positions apart up to there.
SIZE_LIMITS = dict(
    vocab_size=100_000_000,
    hidden_size=1 << 20,
    intermediate_size=1 << 24,
    num_hidden_layers=10_000,
    num_attention_heads=1 << 16,
    num_key_value_heads=1 << 16,
    head_dim=1 << 16,
    max_position_embeddings=1 << 24,
    num_experts=1 << 16,
)
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def size(r: ConfigReader, field: str, default, *, nullable: bool = True) -> int | None:
    """A size field of ``SIZE_LIMITS``, in ``[1, its limit]`` (or null when ``nullable``)."""
    return r.int_(field, default, nullable=nullable, lo=1, hi=SIZE_LIMITS[field])


def positive(r: ConfigReader, field: str, v: float) -> float:
    """``v``, refused unless a positive normal float32 (its tables are float32: a smaller or larger
    value would be 0 or inf there, and the model NaN)."""
    if not _F32_TINY <= v <= _F32_MAX:
        raise r.fail(field, f"= {v!r} must be positive and within float32's range")
    return v


def check_numbers(r: ConfigReader, rec: FamilyRecord, f: dict[str, Any]) -> None:
    """The expert count against ``SIZE_LIMITS``, and the RoPE values whose float32 tables
    (``relax.models.layers.rope``) would otherwise be NaN or infinite: thetas and factors
    positive, llama3's ``low_freq_factor < high_freq_factor``, an original context >= 1."""
    names = rec.moe_names.get("num_experts", ("num_experts",))
    experts = next((n for n in names if r.d.get(n) is not None), names[0])
    if f.get("num_experts", 0) > SIZE_LIMITS["num_experts"]:
        raise r.fail(
            experts, f"must be at most {SIZE_LIMITS['num_experts']}, got {f['num_experts']}"
        )
    at = f"{'rope_scaling' if r.d.get('rope_scaling') else 'rope_parameters'}."
    params = r.d.get("rope_scaling") or r.d.get("rope_parameters")
    in_params = isinstance(params, dict) and "rope_theta" in params
    positive(r, f"{at if in_params else ''}rope_theta", f["rope_theta"])
    if f.get("rope_local_theta") is not None:
        positive(r, "rope_local_base_freq", f["rope_local_theta"])
    s: RopeScaling | None = f["rope_scaling"]
    if s is None:
        return
    positive(r, at + "factor", s.factor)
    if s.original_max_position < 1:
        raise r.fail(at + ORIGINAL, f"must be >= 1, got {s.original_max_position}")
    if s.kind == "llama3" and not 0 < s.low_freq_factor < s.high_freq_factor:
        raise r.fail(
            at + "low_freq_factor",
            f"= {s.low_freq_factor} must be positive and below high_freq_factor = "
            f"{s.high_freq_factor} (transformers divides by their difference)",
        )
    if s.kind == "longrope":
        positive(r, at + "attention_factor", s.attention_factor)
        for name in ("short_factor", "long_factor"):
            for v in getattr(s, name):
                positive(r, f"{at}{name}", v)
