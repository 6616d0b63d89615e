"""LoRA on the weights of any module (a vision-language model's tower, ``--lora.vision``).

A weight ``W [..., in, out]`` at a path of the module (``"visual.blocks.qkv"``: attributes from
the module down, the leading axes its stacked layers) gets two factors, ``A [..., in, r]`` and
``B [..., r, out]`` (``B = 0``: exactly the base), and the module runs with the merged weights::

    W_p  ->  W_p + s A_p B_p          s = alpha / r   (rsLoRA: alpha / sqrt(r))

formed in each forward (``merged_module``): a tower's weights are few beside its activations over a
batch's images, and its own code runs unchanged. The factors are PEFT's ``lora_A`` / ``lora_B``
transposed, as the language model's are (``relax.models.layers.lora``); only they train
(``relax.models.adapters.operations.trainable``). The adapters take no dropout (they are merged).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.models.layers.lora import LoRAConfig

__all__ = ["ModuleLoRA", "add_module_lora", "merged_module", "weight_at"]


class ModuleLoRA(eqx.Module):
    """``base`` (a module) with adapters ``a[path]`` ``[..., in, r]`` and ``b[path]`` ``[..., r,
    out]`` on the weights at those paths, scaled by ``scale``."""

    base: Any
    a: dict[str, Float[Array, "... i r"]]
    b: dict[str, Float[Array, "... r o"]]
    scale: float = eqx.field(static=True)


def weight_at(module: Any, path: str) -> Any:
    """The leaf of ``module`` at ``path`` (attribute names joined by dots)."""
    return functools.reduce(getattr, path.split("."), module)


def add_module_lora(
    module: Any, paths: Sequence[str], cfg: LoRAConfig, key: jax.Array
) -> ModuleLoRA:
    """``module`` with fresh adapters of ``cfg`` (its ``rank``, ``alpha``, ``init``, ``dtype``,
    ``use_rslora``) on the weights at ``paths``: ``A`` drawn as PEFT draws it (Kaiming-uniform
    ``U(-1/sqrt(in), 1/sqrt(in))``, or normal with standard deviation ``1/r``), ``B = 0``."""
    if not cfg.enabled:
        raise ValueError("LoRAConfig.rank is 0: no adapters to add")
    a, b = {}, {}
    for i, path in enumerate(paths):
        w = weight_at(module, path)
        dtype = w.dtype if cfg.dtype == "base" else jnp.dtype(cfg.dtype)
        *lead, fan_in, fan_out = w.shape
        k = jax.random.fold_in(key, i)
        shape = (*lead, fan_in, cfg.rank)
        if cfg.init == "gaussian":
            a[path] = (jax.random.normal(k, shape, jnp.float32) / cfg.rank).astype(dtype)
        else:
            bound = 1.0 / math.sqrt(fan_in)
            a[path] = jax.random.uniform(k, shape, jnp.float32, -bound, bound).astype(dtype)
        b[path] = jnp.zeros((*lead, cfg.rank, fan_out), dtype)
    return ModuleLoRA(module, a, b, cfg.scale)


def merged_module(m: Any) -> Any:
    """The module ``m`` computes: ``base`` with every adapted weight ``W + s A B`` (in ``W``'s
    dtype, the product in float32); any other module as it is."""
    if not isinstance(m, ModuleLoRA):
        return m
    paths = sorted(m.a)
    merged = [
        (
            weight_at(m.base, p).astype(jnp.float32)
            + m.scale * jnp.matmul(m.a[p].astype(jnp.float32), m.b[p].astype(jnp.float32))
        ).astype(weight_at(m.base, p).dtype)
        for p in paths
    ]
    return eqx.tree_at(lambda t: [weight_at(t, p) for p in paths], m.base, merged)
