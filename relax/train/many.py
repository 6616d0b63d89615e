"""K LoRA adapters on one base, trained in one program: ``jax.vmap`` over a stack of adapters.

    model = stack_adapters([add_lora(base, lora, k) for k in keys])     # adapters [K, L, ...], one base
    opt = with_learning_rate_scale(cfg.optimizer.make())
    opt_state = init_many(opt, model, learning_rate_scales=[0.3, 1.0, 3.0])
    update = vmap_over_adapters(make_update(loss_fn, opt, ...), model)
    model, opt_state, metrics = update(model, opt_state, batch, keys)  # metrics [K]

The base weights are read once per layer for all K adapters (``in_axes=None``); each adapter
has its own optimizer state, learning-rate scale (``with_learning_rate_scale``: AdamW's update
times ``m_k`` is AdamW at learning rate ``m_k lr``) and metrics. The batch is shared.
``benchmarks/memory.py`` compares this with K sequential runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from relax.models.adapters.operations import has_lora, split_trainable, with_adapters
from relax.models.decoder.transformer import Transformer


class ScaledState(NamedTuple):
    inner: optax.OptState
    scale: jax.Array  # the learning-rate multiplier m


def with_learning_rate_scale(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner``'s updates times ``state.scale`` (1 at init): for AdamW (decay included), the
    optimizer at learning rate ``scale * lr``. ``init_many`` sets one scale per adapter."""

    def init(params):
        return ScaledState(inner.init(params), jnp.ones((), jnp.float32))

    def update(grads, state, params=None):
        updates, inner_state = inner.update(grads, state.inner, params)
        updates = jax.tree.map(lambda u: (state.scale * u).astype(u.dtype), updates)
        return updates, ScaledState(inner_state, state.scale)

    return optax.GradientTransformation(init, update)


def stack_adapters(models: Sequence[Transformer]) -> Transformer:
    """One model: the first one's base with every model's adapters stacked on a leading ``[K]``."""
    if not models or not all(has_lora(m) for m in models):
        raise ValueError("stack_adapters needs one or more models with LoRA adapters")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(m.layers.lora for m in models))
    return with_adapters(models[0], stacked)


def adapter(model: Transformer, k: int) -> Transformer:
    """The base with adapter ``k`` of a stacked model."""
    return with_adapters(model, jax.tree.map(lambda x: x[k], model.layers.lora))


def adapter_axes(model: Transformer) -> Any:
    """``in_axes`` for ``model``: 0 at the adapter leaves, None (shared) at the base's."""
    marks = jax.tree.map(lambda _: None, model)
    return with_adapters(marks, jax.tree.map(lambda _: 0, model.layers.lora))


def init_many(
    optimizer: optax.GradientTransformation,
    model: Transformer,
    learning_rate_scales: Sequence[float] | None = None,
) -> optax.OptState:
    """One optimizer state per adapter of a stacked ``model`` (leaves ``[K, ...]``); with
    ``learning_rate_scales`` (K values) the ``ScaledState`` multipliers are set to them."""
    trained = split_trainable(model)[0]
    state = jax.vmap(optimizer.init, in_axes=(adapter_axes(trained),))(trained)
    if learning_rate_scales is None:
        return state
    scales = jnp.asarray(learning_rate_scales, jnp.float32)
    found = optax.tree_utils.tree_get_all_with_path(state, "scale")
    if len(found) != 1 or found[0][1].shape != scales.shape:
        raise ValueError(
            f"learning_rate_scales needs an optimizer built with with_learning_rate_scale and "
            f"{found[0][1].shape[0] if found else '?'} values, got {len(learning_rate_scales)}"
        )
    return optax.tree_utils.tree_set(state, scale=scales)


def vmap_over_adapters(update: Callable, model: Transformer) -> Callable:
    """``update(params, opt_state, batch, key, ref_is_policy=False)`` (``relax.train.update``) over
    every adapter of a stacked ``model`` at once: ``(model, opt_states, batch, keys [K])`` ->
    ``(model, opt_states, metrics [K])``, the base and the batch shared."""
    axes = adapter_axes(model)
    return jax.vmap(update, in_axes=(axes, 0, None, 0), out_axes=(axes, 0, 0))
