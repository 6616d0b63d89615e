"""The generic update every trainer runs: ``epochs`` x ``minibatches`` optimizer steps, each the
sum of ``grad_accum`` micro-batch gradients, as nested ``lax.scan``s (docs/architecture.md,
"The update").

An algorithm brings a loss ``loss_fn(params, micro_batch, ctx) -> (scalar, metrics)``. The batch
is a pytree whose leaves share a leading ROW axis (prompt groups for RL, examples or pairs
offline); each epoch permutes the rows and reshapes them into ``[minibatches, grad_accum,
rows_per_micro, ...]``. Loss normalisers are computed ONCE from the whole batch
(``normalizers(batch)``, e.g. its loss tokens and sequences) and divided by the number of
minibatches::

    ctx.norms[k] = normalizers(batch)[k] / minibatches

so every token weighs the same in every optimizer step however the rows fall into
minibatches, and the micro-batch losses of a step sum to exactly the minibatch loss: gradient
accumulation does not change what the loss means (the loss must divide by ``ctx.norms``, not
by counts of its own micro-batch).

Metrics are reduced as each declares (``relax.metrics``); every step adds ``loss`` (the sum of
its micro-batch losses), ``grad_norm`` and ``first_nonfinite_grad`` (the index of the first
non-finite gradient leaf of a step the optimizer's non-finite guard skipped, else -1). Gradient
clipping and the guard itself are optax transformations of the optimizer
(``relax.train.optimizer``).

``track_reference``: while the params are bitwise the KL reference (``ctx.ref_is_policy``: the
first iteration of a static reference, or right after a reset), a loss takes the reference
log-probs to be its own under a stop-gradient, so the KL term and its gradient are exactly 0
whatever the pass layout; the flag is carried through the steps and cleared by the first step
that changes a weight (``relax.objectives.reference.params_equal``).

Only the trainable leaves are differentiated and updated (``relax.models.adapters.operations.trainable``):
with LoRA the adapters, the base weights being constants of the loss. When an adapter has
dropout, each micro-batch's forward gets its own dropout key.

``side``: inputs of the rows computed from a second part of the params (a trained vision tower's
image features), once per optimizer step for the whole batch and inside its gradient. The params
are then ``(main, side_params)`` and each step is::

    r, pullback = vjp(lambda s: side.encode(s, side_data), side_params)      r: [rows, ...]
    g_main, g_r[i] = grad over (main, r_i) of loss(main, side.place(mb_i, r_i))   (micro-batch i)
    g_side = pullback(scatter(g_r))            (each row's cotangent at its row of r)

so the side part runs once per row per optimizer step however the rows fall into micro-batches,
and its gradient is that of the whole minibatch loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool

from relax import metrics as M
from relax.models.adapters.operations import split_trainable, uses_dropout, with_dropout_key
from relax.objectives.reference import params_equal
from relax.passes import Passes
from relax.train.health import first_nonfinite_leaf
from relax.train.optimizer import skip_counts
from relax.train.state import TrainState, policy_and_vision, trained_params


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What a loss gets besides its params and micro-batch: the batch-wide normalisers and
    whether the params are bitwise the reference model. A pytree (both fields are arrays)."""

    norms: Mapping[str, Array]
    ref_is_policy: Bool[Array, ""]


jax.tree_util.register_dataclass(
    LossContext, data_fields=["norms", "ref_is_policy"], meta_fields=[]
)

LossFn = Callable[[Any, Any, LossContext], "tuple[Array, Mapping[str, Array | M.Metric]]"]


@dataclasses.dataclass(frozen=True)
class SideInputs:
    """Row inputs made by a second part of the params (module docstring): ``encode(side_params,
    side_data) -> rows`` (every leaf ``[rows, ...]``, the batch's row order) and
    ``place(micro_batch, rows_of_it) -> micro_batch`` (what the loss then reads)."""

    encode: Callable[[Any, Any], Any]
    place: Callable[[Any, Any], Any]


class Updated(eqx.Module):
    """What an update stage returns as its batch: the batch it trained on, the step's metrics
    (reduced, ``relax.metrics``) and its health record (``relax.train.health.step_health``)."""

    batch: Any
    metrics: dict[str, Array]
    health: dict[str, Array]


def token_share(loss: Array, mask: Array, ctx: LossContext) -> Array:
    """A per-forward loss (a router loss) weighted by its micro-batch's share of the batch's loss
    tokens, ``loss * sum(mask) / norms["tokens"]``: the micro-batches' terms add up to their
    token-weighted mean, whatever the gradient accumulation."""
    return loss * jnp.sum(mask.astype(jnp.float32)) / ctx.norms["tokens"]


def loss_mask_of(batch) -> Array:
    """The batch's ``loss_mask`` (``[rows, ..., T]``): the tokens its loss counts."""
    return batch["loss_mask"] if isinstance(batch, Mapping) else batch.loss_mask


def token_normalizers(batch) -> dict[str, Array]:
    """The default normalisers: valid loss tokens and sequences with at least one of them, from
    the batch's ``loss_mask`` (``[rows, ..., T]``), each at least 1."""
    loss_mask = loss_mask_of(batch)
    seq_valid = jnp.any(loss_mask > 0, axis=-1)
    return {
        "tokens": jnp.maximum(jnp.sum(loss_mask), 1).astype(jnp.float32),
        "sequences": jnp.maximum(jnp.sum(seq_valid), 1).astype(jnp.float32),
    }


def row_positions(batch) -> int:
    """The positions one row of ``batch`` trains on, what the default micro-batching budgets: its
    completion slots where it has completions (``tokens [rows, ..., N]``: a prompt group's ``G x
    N``, a preference pair's ``2 x N``; the prompt, which its completions share, is not counted),
    else its ``loss_mask``'s (``[rows, ..., T]``)."""
    return math.prod(_rows_array(batch).shape[1:])


def forward_groups(passes: Passes, batch) -> int | None:
    """Rows per forward-only pass over ``batch`` (a reference's, a proximal policy's, a
    teacher's): ``Passes.groups_per_pass`` of its rows of ``row_positions`` positions each."""
    return passes.groups_per_pass(_rows_array(batch).shape[0], row_positions(batch))


def _rows_array(batch):
    """``batch``'s ``tokens`` (rows of completions) if it has them, else its ``loss_mask``."""
    tokens = batch.get("tokens") if isinstance(batch, Mapping) else getattr(batch, "tokens", None)
    return loss_mask_of(batch) if tokens is None else tokens


def micro_batch_split(
    rows: int, minibatches: int, grad_accum: int | None, passes: Passes, row_tokens: int = 0
) -> int:
    """The micro-batches per minibatch (``grad_accum``, or when None the passes' choice for rows
    of ``row_tokens`` positions), checked."""
    if rows % minibatches:
        raise ValueError(f"{rows} rows per batch do not split into minibatches={minibatches}")
    a = passes.micro_batches(rows // minibatches, row_tokens) if grad_accum is None else grad_accum
    if a < 1 or rows % (minibatches * a):
        raise ValueError(
            f"{rows} rows per batch do not split into minibatches={minibatches} x grad_accum={a}"
        )
    return a


def micro_batch_text(
    rows: int, minibatches: int, grad_accum: int | None, passes: Passes, row_tokens: int, flag: str
) -> str:
    """A start-up report's words on the update's micro-batches (``micro_batch_split``): how many
    per optimizer step, the rows and positions per device of each, and ``flag`` that sets them."""
    a = micro_batch_split(rows, minibatches, grad_accum, passes, row_tokens)
    per = rows // (minibatches * a)
    shards = passes.batch_shards if per % passes.batch_shards == 0 else 1
    head = (
        f"{a} micro-batch(es) of {per} row(s) per optimizer step, "
        f"{per // shards * row_tokens:,} positions per device: "
    )
    if grad_accum is not None:
        return head + f"{flag} {grad_accum}"
    if passes.cache_sized:
        return head + "one row each on a CPU device"
    budget = passes.micro_batch_tokens
    limit = "the whole minibatch" if budget is None else f"at most {budget:,} per device"
    return head + f"{limit} ({flag} sets them)"


def make_update(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    epochs: int = 1,
    minibatches: int = 1,
    grad_accum: int | None = None,
    passes: Passes = Passes(),
    normalizers: Callable[[Any], Mapping[str, Array]] = token_normalizers,
    track_reference: bool = False,
    skip_empty: bool = False,
    side: SideInputs | None = None,
):
    """``update(params, opt_state, batch, key, ref_is_policy=False, side_data=None) -> (params,
    opt_state, metrics)``.

    ``grad_accum=None`` leaves the micro-batching to ``passes`` (``Passes.micro_batches``: one row
    per micro-batch on cache-sized passes, a token budget per device elsewhere, counted in
    ``row_positions``). Metrics come back reduced, as plain arrays.

    Args:
        loss_fn: ``loss_fn(params, micro_batch, ctx) -> (scalar, metrics)``; it divides by
            ``ctx.norms``, not by counts of its own micro-batch (module docstring).
        optimizer: the optax optimizer of the trainable leaves.
        epochs: passes over the batch, each in a new random row order (default 1).
        minibatches: optimizer steps per epoch; it must divide the batch's rows (default 1).
        grad_accum: micro-batches per optimizer step, their gradients summed; it must divide the
            rows of a minibatch. None (default): the passes' choice (``Passes.micro_batches``).
        passes: the backend's pass layout (``relax.passes.Passes``): the micro-batching when
            ``grad_accum`` is None, and the order of the weight comparison of
            ``track_reference``.
        normalizers: ``normalizers(batch) -> {name: scalar}``, computed once per batch; each is
            divided by ``minibatches`` into ``ctx.norms``. Default: ``token_normalizers``
            (``tokens``, ``sequences`` of the batch's ``loss_mask``).
        track_reference: carry ``ctx.ref_is_policy`` from the call's ``ref_is_policy`` through
            the steps, cleared by the first step that changes a weight (default False: it stays
            as given).
        skip_empty: rows with no loss token (the empty bins of a packed batch) are not computed:
            each epoch deals the rows with a loss token first, round-robin over the minibatches
            (their counts differ by at most one), and a micro-batch with no loss token contributes
            zero gradient and neutral metrics without running the loss (default False: every
            micro-batch runs, the rows split in their random order).
        side: row inputs computed from the params' second part in each step (module docstring);
            the params are ``(main, side_params)``, ``loss_fn`` gets ``main`` and
            ``side.place(micro_batch, rows)``, and ``update`` takes ``side_data``. None (default):
            the params are the loss's.

    Returns:
        ``update(params, opt_state, batch, key, ref_is_policy=False, side_data=None)``, pure and
            jittable. ``batch``
            is a pytree whose leaves share a leading row axis; ``key`` draws each epoch's row order
            (and the adapters' dropout keys). It returns ``(params, opt_state, metrics)``: the
            params with the trainable leaves updated, the new optimizer state, and a dict of arrays:
            the loss's metrics, ``loss``, ``grad_norm`` and ``first_nonfinite_grad``, each reduced
            over the micro-batches and steps as it declares (``relax.metrics``).
    """
    if epochs < 1 or minibatches < 1:
        raise ValueError(f"epochs={epochs} and minibatches={minibatches} must be >= 1")

    def loss_of_trained(learned, rows, frozen, mb, ctx, key):
        """``learned``: the trainable leaves the loss reads (with a side part: the main part's
        alone, the side part reaching the loss through ``rows``)."""
        if side is not None:
            frozen, mb = frozen[0], side.place(mb, rows)
        params = eqx.combine(learned, frozen)
        params = params if key is None else with_dropout_key(params, key)
        return _declared(loss_fn(params, mb, ctx))

    grad_fn = jax.value_and_grad(loss_of_trained, argnums=(0, 1), has_aux=True)

    def update(params, opt_state, batch, key, ref_is_policy=False, side_data=None):
        rows = jax.tree.leaves(batch)[0].shape[0]
        row_tokens = row_positions(batch)
        a, m = micro_batch_split(rows, minibatches, grad_accum, passes, row_tokens), minibatches
        norms = {k: v / m for k, v in normalizers(batch).items()}
        dropout = uses_dropout(params)
        trained, frozen = split_trainable(params)

        def step(carry, xs):
            trained, opt_state, same = carry
            mb, keys, idx = xs
            ctx = LossContext(norms, same)
            encoded, pullback = _side_rows(side, trained, frozen, side_data)
            learned = trained if side is None else trained[0]  # what the loss differentiates

            def micro(acc, xs):
                grads_so_far, cotangent = acc  # the side rows' cotangent, at their rows
                micro_batch, k, i = xs
                r = None if side is None else jax.tree.map(lambda e: e[i], encoded)
                run = lambda: grad_fn(learned, r, frozen, micro_batch, ctx, k)  # noqa: E731
                if skip_empty:
                    (loss, metrics), (grads, g_rows) = jax.lax.cond(
                        _weight(micro_batch) > 0, run, functools.partial(_neutral, run)
                    )
                else:
                    (loss, metrics), (grads, g_rows) = run()
                if side is not None:
                    cotangent = jax.tree.map(lambda c, g: c.at[i].add(g), cotangent, g_rows)
                acc = (jax.tree.map(jnp.add, grads_so_far, grads), cotangent)
                return acc, (loss, metrics, _weight(micro_batch))

            zeros = jax.tree.map(jnp.zeros_like, (learned, encoded))
            (grads, cotangent), (losses, metrics, weights) = jax.lax.scan(
                micro, zeros, (mb, keys, idx)
            )
            if side is not None:  # the rows' cotangents through the side part, once
                grads = (grads, pullback(cotangent)[0])
            skipped_before = skip_counts(opt_state)[1]
            updates, opt_state = optimizer.update(grads, opt_state, trained)
            new_trained = optax.apply_updates(trained, updates)
            if (
                track_reference
            ):  # still the reference only if no weight changed (lr 0, a skipped step)
                same = jax.lax.cond(
                    same,
                    lambda: params_equal(new_trained, trained, smallest_first=passes.cache_sized),
                    lambda: jnp.bool_(False),
                )
            skipped = skip_counts(opt_state)[1] > skipped_before
            metrics = {
                **M.reduce_micro(metrics, weights),
                "loss": M.Metric(jnp.sum(losses), "mean"),
                "grad_norm": M.Metric(optax.tree.norm(grads), "mean"),
                "first_nonfinite_grad": M.Metric(
                    jax.lax.cond(skipped, lambda: first_nonfinite_leaf(grads), lambda: -1),
                    "first_found",
                ),
            }
            return (new_trained, opt_state, same), metrics

        def epoch(carry, epoch_key):
            perm = jax.random.permutation(epoch_key, rows)
            if skip_empty:
                perm = _dealt(perm, _row_tokens(batch) > 0, m)
            split = lambda x: x[perm].reshape((m, a, rows // (m * a)) + x.shape[1:])  # noqa: E731
            keys = jax.random.split(jax.random.fold_in(epoch_key, 1), (m, a)) if dropout else None
            xs = (jax.tree.map(split, batch), keys, split(jnp.arange(rows)))
            return jax.lax.scan(step, carry, xs)

        carry = (trained, opt_state, jnp.asarray(ref_is_policy, bool))
        (trained, opt_state, _), metrics = jax.lax.scan(epoch, carry, jax.random.split(key, epochs))
        return eqx.combine(trained, frozen), opt_state, M.values(M.reduce_steps(metrics))

    return update


def update_policy(update_fn, state: TrainState, rows, key, ref_is_policy=False, side_data=None):
    """``update_fn`` (``make_update``'s, or a packed update's: ``side_data`` None is not passed)
    on the state's trained params (``trained_params``: the policy, with its trained vision part):
    ``(policy, vision, opt_state, metrics)``, ``vision`` None when the state trains none."""
    params = trained_params(state.policy, state.vision)
    side = () if side_data is None else (side_data,)
    params, opt_state, metrics = update_fn(params, state.opt_state, rows, key, ref_is_policy, *side)
    return (*policy_and_vision(params, state), opt_state, metrics)


def _side_rows(side: SideInputs | None, trained, frozen, side_data):
    """``(rows, pullback)``: the side part's row inputs for the whole batch and the vjp of them
    with respect to its trained leaves (``(None, None)`` without a side part)."""
    if side is None:
        return None, None
    encode = lambda t: side.encode(eqx.combine(t, frozen[1]), side_data)  # noqa: E731
    return jax.vjp(encode, trained[1])


def _declared(out):
    loss, metrics = out
    return loss, {k: M.as_metric(v) for k, v in metrics.items()}


def _neutral(run):
    """What a skipped micro-batch contributes: ``run``'s outputs as zeros, its metrics neutral
    (``relax.metrics.neutral``)."""
    (loss, metrics), grads = jax.eval_shape(run)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    return (zeros(loss), {k: M.neutral(v) for k, v in metrics.items()}), jax.tree.map(zeros, grads)


def _row_tokens(batch) -> Array:
    """Loss tokens per row ``[rows]``."""
    mask = loss_mask_of(batch)
    return jnp.sum(mask.reshape(mask.shape[0], -1), axis=1)


def _dealt(perm: Array, active: Array, m: int) -> Array:
    """``perm`` with its active rows first, dealt round-robin: minibatch ``i`` takes positions
    ``i, i + m, ...``, so each minibatch has its share of active rows, first."""
    perm = perm[jnp.argsort(~active[perm], stable=True)]
    return perm.reshape(-1, m).T.reshape(-1)


def _weight(micro_batch) -> Array:
    """A micro-batch's weight in token-weighted metric means: its loss tokens."""
    return jnp.sum(loss_mask_of(micro_batch)).astype(jnp.float32)
