"""LoRA adapters on a ``Transformer``: add, switch off, merge, and split the trainable part
(a tower's adapters: ``relax.models.adapters.tower``).

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

from relax.models.adapters.tower import ModuleLoRA
from relax.models.config.model import ModelConfig
from relax.models.decoder.transformer import Transformer
from relax.models.layers.lora import TARGETS, Adapters, LoRAConfig, init_adapters, merged_weight


def _is_model(x) -> bool:
    return isinstance(x, Transformer)


def has_lora(model) -> bool:
    return isinstance(model, Transformer) and model.layers.lora is not None


def add_lora(model: Transformer, cfg: LoRAConfig, key: Array) -> Transformer:
    """``model`` with fresh adapters (``cfg.rank > 0``) on its targeted weights
    (``adapter_fields``).

    Args:
        model: a ``Transformer`` without adapters.
        cfg: the adapters' ``LoRAConfig``: ``rank`` (> 0), ``alpha``, ``dropout``,
            ``target_modules``, ``init``, ``dtype``.
        key: the PRNG key of the ``A`` matrices (``B`` starts at 0).

    Returns:
        ``model`` with ``layers.lora`` set: every base array shared, not copied. With ``B = 0`` it
            computes exactly what ``model`` does; only the adapters train.
    """
    if not cfg.enabled:
        raise ValueError("LoRAConfig.rank is 0: no adapters to add")
    if has_lora(model):
        raise ValueError("the model has adapters already (merge_lora or lora_off first)")
    stacked = model.config.stacked_shapes()
    shapes = {f: stacked[f] for f in adapter_fields(cfg, model.config)}
    return with_adapters(model, init_adapters(cfg, shapes, key, model.layers.wq.dtype))


def adapter_fields(cfg: LoRAConfig, config: ModelConfig) -> tuple[str, ...]:
    """The weights ``cfg`` adapts on a model of ``config``: those of ``cfg.fields()`` it has.

    ``gate_proj`` / ``up_proj`` / ``down_proj`` are the dense MLP's on dense layers and the shared
    expert's on sparse ones (Qwen2-MoE), ``shared_expert_gate`` the shared expert's gate, as PEFT
    matches them; a mixture's experts and router are never adapted (PEFT does not either: they
    are not ``Linear`` modules), which ``"all-linear"`` on such a model says in a warning. A
    target the model has no weight for is an error.
    """
    have = config.layer_shapes()
    absent = [
        m for m in cfg.target_modules if m != "all-linear" and not set(TARGETS[m]) & set(have)
    ]
    if absent:
        why = (
            "its MLP weights are experts, which relax does not adapt (nor does PEFT)"
            if config.num_experts
            else "it has no such layer"
        )
        free = sorted(m for m, fs in TARGETS.items() if set(fs) & set(have))
        raise ValueError(
            f"lora target_modules {absent}: no such linear layer in this {config.family} model ({why}); "
            f"it has {free}"
        )
    fields = tuple(f for f in cfg.fields() if f in have)
    if config.num_experts and "all-linear" in cfg.target_modules:
        warnings.warn(
            f"lora target 'all-linear' on a mixture-of-experts model adapts {list(fields)}: the experts "
            "and their router are not adapted (PEFT's all-linear leaves them too)",
            stacklevel=3,
        )
    return fields


def with_adapters(model: Transformer, adapters: Adapters | None) -> Transformer:
    """``model`` with ``adapters`` in place of its own (None: without any)."""
    return dataclasses.replace(model, layers=dataclasses.replace(model.layers, lora=adapters))


def lora_off(model: Transformer) -> Transformer:
    """The base model: adapters switched off, every other array shared with ``model``."""
    return with_adapters(model, None)


def merge_lora(model: Transformer) -> Transformer:
    """A plain ``Transformer`` whose targeted weights are ``W + s A B`` (no adapters).

    Args:
        model: a ``Transformer``, with or without adapters.

    Returns:
        A ``Transformer`` without adapters: each adapted weight replaced by ``W + s A B`` (computed
            in float32, rounded once to ``W``'s dtype), the other arrays shared with ``model``.
            ``model`` itself when it has no adapters.
    """
    ad = model.layers.lora
    if ad is None:
        return model
    merged = {
        f: merged_weight(getattr(model.layers, f), lw, ad.scale) for f, lw in ad.weights().items()
    }
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
    """A filter pytree for ``eqx.partition``: True at the leaves an optimizer trains (a
    ``ModuleLoRA``'s adapters, not its base)."""

    def mark(x):
        if isinstance(x, ModuleLoRA):
            inexact = lambda t: jax.tree.map(eqx.is_inexact_array, t)  # noqa: E731
            return ModuleLoRA(
                jax.tree.map(lambda _: False, x.base), inexact(x.a), inexact(x.b), x.scale
            )
        if not has_lora(x):
            return jax.tree.map(eqx.is_inexact_array, x)
        frozen = jax.tree.map(lambda _: False, x)
        return eqx.tree_at(
            lambda m: m.layers.lora, frozen, jax.tree.map(eqx.is_inexact_array, x.layers.lora)
        )

    return jax.tree.map(mark, tree, is_leaf=lambda x: _is_model(x) or isinstance(x, ModuleLoRA))


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
    return jax.tree.map(
        lambda x: eqx.filter(x, trainable(x)) if has_lora(x) else x, tree, is_leaf=_is_model
    )


def base_weights(tree):
    """The base weights of every LoRA model in ``tree`` (None elsewhere)."""
    return jax.tree.map(
        lambda x: eqx.filter(x, trainable(x), inverse=True) if has_lora(x) else None,
        tree,
        is_leaf=_is_model,
    )
