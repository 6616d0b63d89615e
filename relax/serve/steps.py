"""The programs a session runs, each a ``step(options, *args)`` that ``relax.serve.programs``
compiles once per shape and structure, a request's numbers in ``options`` as arguments.

=========================  ===========================================================
``datum_step``             a datum loss's ``(grads, metrics, logp, finite)`` over rows
``objective_step``         a named objective's ``(grads, metrics, finite)`` over a batch
``accumulate``             pending gradients plus new ones, and whether the sum is finite
``optim``                  one optimizer step: ``(state, grad_norm, finite)``
``sample_step``            the sampler's program at the request's temperature and top-p
=========================  ===========================================================

``finite`` says whether the result is: the loss and the gradients' global norm (finite in
float32: then so is every gradient, and Adam's squares of them), the sum's norm, or every float
of the new weights and optimizer moments; a session keeps a result only when it is.

Optimizer: ``clip_by_global_norm(max_grad_norm) -> adamw`` with every hyperparameter injected
(``optax.inject_hyperparams``), set from each ``optim_step``'s ``AdamParams``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from relax.models.adapters.operations import split_trainable
from relax.rollout.sampler import RolloutConfig, generate_program
from relax.rollout.sampling import SamplingConfig
from relax.serve import objectives
from relax.serve.datum import datum_loss
from relax.serve.objectives import Grads
from relax.serve.programs import Option
from relax.train import primitives
from relax.train.state import TrainState

__all__ = [
    "OPTIMIZER",
    "accumulate",
    "all_finite",
    "finite_grads",
    "datum_step",
    "objective_step",
    "optim",
    "sample_step",
    "trained",
]


def _adam(learning_rate, b1, b2, eps, weight_decay, max_grad_norm):
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
    )


OPTIMIZER = optax.inject_hyperparams(_adam)(
    learning_rate=1e-4, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0, max_grad_norm=math.inf
)


def finite_grads(loss, grads) -> jax.Array:
    """Whether the loss and the gradients' global norm are finite in float32 (every gradient
    finite, and none so large that Adam's ``g**2`` or the norm a clip divides by overflows)."""
    return jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))


def all_finite(tree) -> jax.Array:
    """Whether every float of ``tree`` is finite (a scalar bool)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def trained(state: TrainState) -> Any:
    """What an optimizer step changes: the policy's trainable leaves, the critic, both
    optimizers' moments (not their injected hyperparameters: ``max_grad_norm`` may be inf)."""

    def moments(opt_state):
        return None if opt_state is None else opt_state.inner_state

    return (
        split_trainable(state.policy)[0],
        moments(state.opt_state),
        state.critic,
        moments(state.critic_opt_state),
    )


def _value(x):
    return x.traced if isinstance(x, Option) else x


def datum_step(loss: str, statics: tuple, backward: bool):
    """``(options, state, rows) -> (grads, metrics, logp, finite)`` of a datum loss."""

    def step(options, state, rows):
        fn = datum_loss(loss, {**dict(statics), **options})
        if not backward:
            value, (logp, metrics) = fn(state.policy, rows)
            return None, {**metrics, "loss": value}, logp, jnp.isfinite(value)
        grads, metrics = primitives.forward_backward(state, rows, lambda p, r: _swap(fn(p, r)))
        metrics, logp = {k: v for k, v in metrics.items() if k != "logp"}, metrics["logp"]
        return Grads(grads), metrics, logp, finite_grads(metrics["loss"], grads)

    return step


def _swap(out):
    value, (logp, metrics) = out
    return value, {**metrics, "logp": logp}


def objective_step(loss: str, statics: tuple, backward: bool):
    """``(options, state, batch) -> (grads, metrics, finite)`` of a named objective."""

    def step(options, state, batch):
        kwargs = {**dict(statics), **options}
        if backward:
            grads, metrics = objectives.objective_forward_backward(state, batch, loss, **kwargs)
            return grads, metrics, finite_grads(metrics["loss"], grads)
        params, loss_fn = objectives.objective_loss(state, batch, loss, **kwargs)
        value, metrics = loss_fn(params)
        metrics = {**{k: getattr(v, "value", v) for k, v in metrics.items()}, "loss": value}
        return None, metrics, jnp.isfinite(value)

    return step


def accumulate(options, pending, grads):
    total = jax.tree.map(jnp.add, pending, grads)
    return total, jnp.isfinite(optax.tree.norm(total))


def optim(options, state: TrainState, grads: Grads):
    """One step of ``state``'s optimizers on ``grads`` with ``options`` (``_adam``'s
    hyperparameters, traced), its gradient norm, and whether what it changed is finite."""
    hyper = {k: jnp.asarray(_value(v), jnp.float32) for k, v in options.items()}

    def injected(opt_state):
        return None if opt_state is None else opt_state._replace(hyperparams=hyper)

    state = state.replace(
        opt_state=injected(state.opt_state), critic_opt_state=injected(state.critic_opt_state)
    )
    new = objectives.objective_optim_step(state, grads)
    return new, optax.tree.norm(grads.policy), all_finite(trained(new))


def sample_step(num: int, max_new: int, top_k: int | None, eos_ids: tuple[int, ...]):
    """``(options, policy, ids, mask, key) -> Rollout``: the sampler's program
    (``relax.rollout.sampler.generate_program``) with ``options`` ``temperature`` and, when
    on, ``top_p``."""

    def step(options, policy, ids, mask, key):
        sampling = SamplingConfig(
            temperature=options["temperature"], top_k=top_k, top_p=options.get("top_p")
        )
        cfg = RolloutConfig(
            num_generations=num,
            max_new_tokens=max_new,
            sampling=sampling,
            eos_ids=eos_ids,
            pad_id=0,
        )
        return generate_program(policy, ids, mask, key, cfg)

    return step
