"""Weight-only 8-bit matrices for the sampler: int8 or fp8 (e4m3), one scale per output channel,
quantized and multiplied by qwix (Google's JAX quantization library; the ``quant`` extra,
imported only when a quantized sampler is asked for).

A weight ``W`` whose contracted axis is ``i`` (a layer's ``[i, o]``, stacked layers' ``[L, i, o]``,
the LM head's ``[V, i]``) gets one scale per every other index (per layer and output channel)::

    s    = max_i |W_i| / B           B = 127.5 (int8), 448 (fp8 e4m3: its largest value)
    Q_i  = round(W_i / s)            int8: half to even, saturating to [-128, 127];
                                     fp8: rounded to the nearest e4m3 value
    W^_i = Q_i s                     in the compute dtype (the scale's dtype)
    y    = x W^                      operands in the compute dtype, accumulated in float32

(qwix's convention: ``B = 127.5`` so that the largest weight of a channel sits on the edge of the
top bucket; every weight is within ``s / 2`` of ``W^``.) Quantized from float32 whatever the
parameters' dtype, so no bfloat16 rounding of ``W / s`` comes first.

The product is ``qwix.dot_general`` / ``qwix.einsum`` with a floating-point ``x``: qwix dequantizes
``W^`` and multiplies in the compute dtype (an accelerator's compiler fuses the dequantization into
the product's operand read, so a decode step reads 1 byte per weight; XLA:CPU writes ``W^`` out
first). Its result is exactly ``x W^``: a model whose weights are ``W^`` (``dequantize_fields``)
gives the quantized sampler's log-probs.

Only the weight matrices are quantized; biases, norms, the embedding gather, a mixture's router
and its experts (their grouped products are not qwix's) stay as they are.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

PRECISIONS = ("model", "int8", "fp8")
"""A sampler's weight precision: the model's own (compute dtype), int8 or fp8 e4m3."""
QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
STACKED_WEIGHTS = (
    "wq",
    "wk",
    "wv",
    "wo",
    "w_gate",
    "w_up",
    "w_down",
    "shared_gate",
    "shared_up",
    "shared_down",
)
"""The ``LayerStack`` fields quantized (``[L, i, o]``): the products ``linear`` runs."""
FUSED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "shared_gate", "shared_up", "shared_down")
"""The same weights in a ``FusedLayer`` (``[i, o]``; per output channel, quantizing the fused
columns is quantizing each part's)."""


def qwix():
    """The ``qwix`` module, imported on first use; a clear error naming the extra without it."""
    try:
        return importlib.import_module("qwix")
    except ImportError as e:
        raise ImportError(
            "an int8 / fp8 sampler (sampler_precision) needs qwix, the quant extra: "
            "pip install -e '.[quant]' in the relax checkout"
        ) from e


def is_quantized(w: Any) -> bool:
    """Whether ``w`` is a qwix ``QArray`` (qwix is not imported for this: none exists before it is)."""
    module = sys.modules.get("qwix")
    return module is not None and isinstance(w, module.QArray)


def quantize(w: Float[Array, "..."], precision: str, dtype, *, contract: int = -2) -> Any:
    """``w`` as a ``QArray`` of ``precision`` ("int8" | "fp8"), one scale per index of every axis but
    ``contract`` (module docstring), the scales (so the dequantized weight) in ``dtype``."""
    if precision not in QTYPES:
        raise ValueError(f"sampler_precision {precision!r} quantizes nothing; valid: int8, fp8")
    axis = contract % w.ndim
    channels = tuple(a for a in range(w.ndim) if a != axis)
    return qwix().quantize(
        w.astype(jnp.float32), QTYPES[precision], channelwise_axes=channels, scale_dtype=dtype
    )


def dequantize(w: Any) -> Float[Array, "..."]:
    """``W^ = Q s`` in the scale's dtype (the compute dtype)."""
    return qwix().dequantize(w)


def quantized_matmul(x: Float[Array, "n i"], w: Any, out_dtype) -> Float[Array, "n o"]:
    """``x W^`` for a quantized ``w [i, o]``, accumulated in float32, the result in ``out_dtype``
    (``relax.models.layers.matmul.matmul``'s forward with the dequantized weight)."""
    return qwix().dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


def quantized_einsum(spec: str, x: Float[Array, "..."], w: Any, **kwargs) -> Float[Array, "..."]:
    """``jnp.einsum(spec, x, W^, **kwargs)`` for a quantized ``w`` (the LM head's logits)."""
    return qwix().einsum(spec, x, w, **kwargs)


def quantize_fields(module: Any, fields: Sequence[str], precision: str, dtype) -> Any:
    """The dataclass ``module`` (a ``LayerStack`` or ``FusedLayer``) with each of ``fields`` that it
    has quantized per output channel (absent ones, None, stay None)."""
    return dataclasses.replace(
        module,
        **{
            f: quantize(getattr(module, f), precision, dtype)
            for f in fields
            if getattr(module, f) is not None
        },
    )


def dequantize_fields(module: Any, fields: Sequence[str], precision: str, dtype) -> Any:
    """``module`` with each of ``fields`` replaced by its ``W^`` (quantized, then dequantized): the
    float weights a quantized copy multiplies by."""
    q = quantize_fields(module, fields, precision, dtype)
    return dataclasses.replace(
        q, **{f: dequantize(getattr(q, f)) for f in fields if getattr(q, f) is not None}
    )
