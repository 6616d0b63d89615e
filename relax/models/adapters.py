"""LoRA adapters on a ``Transformer``: add, switch off, merge, and split the trainable part.

    policy = add_lora(base, LoRAConfig(rank=8), key)   # B = 0: exactly the base model
    reference = lora_off(policy)                         # the base: the same arrays, no copy
    full = merge_lora(policy)                            # W + s A B, for export

``trainable`` says which leaves an optimizer sees: only the adapters of a model that has them
(the base weights are then constants of the loss: no gradient, no optimizer state), every
inexact array otherwise. Trees that hold several models (a policy and a value head) are
handled model by model.
"""

from __future__ import annotations

import dataclasses
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from relax.models.config import DENSE_MLP_FIELDS
from relax.models.lora import TARGETS, Adapters, LoRAConfig, init_adapters, merged_weight
from relax.models.transformer import Transformer


def _is_model(x) -> bool:
    return isinstance(x, Transformer)


def has_lora(model) -> bool:
    return isinstance(model, Transformer) and model.layers.lora is not None


def add_lora(model: Transformer, cfg: LoRAConfig, key: Array) -> Transformer:
    """``model`` with fresh adapters (``cfg.rank > 0``) on its targeted weights."""
    if not cfg.enabled:
        raise ValueError("LoRAConfig.rank is 0: no adapters to add")
    if has_lora(model):
        raise ValueError("the model has adapters already (merge_lora or lora_off first)")
    c = model.config
    ad = init_adapters(moe_targets(cfg, c), c.layer_shapes(), c.num_layers, key, model.layers.wq.dtype)
    return with_adapters(model, ad)


def moe_targets(cfg: LoRAConfig, config) -> LoRAConfig:
    """``cfg`` for a mixture-of-experts model: its adapters are on the attention projections, the
    MLP weights being experts (``"all-linear"`` there means the attention projections, with a
    warning; an MLP module named explicitly is an error). A dense model's ``cfg`` unchanged."""
    if not config.num_experts:
        return cfg
    mlp = [m for m, f in TARGETS.items() if f in DENSE_MLP_FIELDS and f in cfg.fields()]
    if not mlp:
        return cfg
    if "all-linear" not in cfg.target_modules:
        raise ValueError(f"lora target_modules {mlp}: a mixture-of-experts model's MLP weights are experts, which "
                         "relax does not adapt; target the attention projections (q/k/v/o_proj)")
    warnings.warn("lora target 'all-linear' on a mixture-of-experts model adapts the attention projections only "
                  "(the experts, their router and any shared expert are not adapted)", stacklevel=3)
    attention = tuple(m for m, f in TARGETS.items() if f not in DENSE_MLP_FIELDS)
    return dataclasses.replace(cfg, target_modules=attention)


def with_adapters(model: Transformer, adapters: Adapters | None) -> Transformer:
    """``model`` with ``adapters`` in place of its own (None: without any)."""
    return dataclasses.replace(model, layers=dataclasses.replace(model.layers, lora=adapters))


def lora_off(model: Transformer) -> Transformer:
    """The base model: adapters switched off, every other array shared with ``model``."""
    return with_adapters(model, None)


def merge_lora(model: Transformer) -> Transformer:
    """A plain ``Transformer`` whose targeted weights are ``W + s A B`` (no adapters)."""
    ad = model.layers.lora
    if ad is None:
        return model
    merged = {f: merged_weight(getattr(model.layers, f), lw, ad.scale) for f, lw in ad.weights().items()}
    return dataclasses.replace(model, layers=dataclasses.replace(model.layers, lora=None, **merged))


def with_dropout_key(tree, key: Array):
    """Every adapter-carrying model in ``tree`` with per-layer dropout keys drawn from ``key``
    (a training forward: ``relax.train.update`` sets them when an adapter has dropout)."""
    def set_key(m):
        if not (has_lora(m) and m.layers.lora.dropout > 0.0):
            return m
        keys = jax.random.split(key, m.config.num_layers)
        return with_adapters(m, dataclasses.replace(m.layers.lora, dropout_key=keys))
    return jax.tree.map(set_key, tree, is_leaf=_is_model)


def uses_dropout(tree) -> bool:
    models = jax.tree.leaves(tree, is_leaf=_is_model)
    return any(has_lora(m) and m.layers.lora.dropout > 0.0 for m in models)


def trainable(tree):
    """A filter pytree for ``eqx.partition``: True at the leaves an optimizer trains."""
    def mark(x):
        if not has_lora(x):
            return jax.tree.map(eqx.is_inexact_array, x)
        frozen = jax.tree.map(lambda _: False, x)
        return eqx.tree_at(lambda m: m.layers.lora, frozen, jax.tree.map(eqx.is_inexact_array, x.layers.lora))
    return jax.tree.map(mark, tree, is_leaf=_is_model)


def split_trainable(tree):
    """``(trainable, frozen)`` halves of ``tree`` (``eqx.partition`` by ``trainable``)."""
    return eqx.partition(tree, trainable(tree))


def adapters_zero(model: Transformer) -> jax.Array:
    """Whether every adapter's ``B`` is exactly zero: the model is then bitwise its base."""
    ws = model.layers.lora.weights().values()
    return jnp.all(jnp.stack([jnp.all(w.b == 0) for w in ws]))


def without_base(tree):
    """``tree`` with every LoRA model reduced to its adapters (None at the base weights): what a
    checkpoint stores of it."""
    return jax.tree.map(lambda x: eqx.filter(x, trainable(x)) if has_lora(x) else x, tree, is_leaf=_is_model)


def base_weights(tree):
    """The base weights of every LoRA model in ``tree`` (None elsewhere)."""
    return jax.tree.map(lambda x: eqx.filter(x, trainable(x), inverse=True) if has_lora(x) else None,
                        tree, is_leaf=_is_model)
