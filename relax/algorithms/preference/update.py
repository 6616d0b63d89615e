"""One optimizer step of a preference loss (the DPO family, KTO) and its bookkeeping:
``run_update`` runs the update on the loss's rows, advances the step and the key as GRPO's
update does, and reports the step's metrics and health (``relax.train.health``), the reference
log-probs of the real rows checked first. ``with_loss_mask`` marks every row of a batch without
a ``loss_mask`` real."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from relax.algorithms.preference.pairs import PairRows
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState
from relax.train.update import Updated, update_policy


def with_loss_mask(batch):
    """``batch`` (a ``PairBatch`` or ``UnpairedBatch``) with ``loss_mask`` ``[P]``: all ones
    (every row real) when it has none."""
    if batch.loss_mask is not None:
        return batch
    return dataclasses.replace(batch, loss_mask=jnp.ones(batch.prompt_ids.shape[:1], jnp.int32))


def ref_is_policy_of(batch) -> jax.Array:
    """The batch's ``ref_is_policy`` as a bool scalar (False when no reference stage set it)."""
    return jnp.asarray(False if batch.ref_is_policy is None else batch.ref_is_policy, bool)


def run_update(
    state: TrainState, batch, update_fn, rows: PairRows, *, ref_logps, side_data=None
) -> tuple[TrainState, Updated]:
    """One ``update_fn`` (``relax.train.update.make_update``) on ``rows``, then ``step + 1`` and the
    new key; the output is ``Updated(batch, metrics, health)``. ``batch``: the step's batch (its
    ``loss_mask`` and ``ref_is_policy``); ``ref_logps``: the reference log-probs the loss read
    (None: none), which the health record checks on the real rows before the loss. A state with
    a trained tower (``state.vision``): ``update_fn`` trains ``(policy, vision)`` with
    ``side_data``, the batch's images (``relax.train.vision_tower``)."""
    ref_is_policy = ref_is_policy_of(batch)
    key, sub = jax.random.split(state.key)
    policy, vision, opt_state, metrics = update_policy(
        update_fn, state, rows, sub, ref_is_policy, side_data
    )
    checked = (batch.loss_mask > 0)[:, None] & ~ref_is_policy  # placeholders are not checked
    first_bad = first_nonfinite(metrics["loss"], ref_logprobs=ref_logps, mask=checked)
    metrics, health = step_health(metrics, opt_state, first_bad)
    new = state.replace(
        policy=policy, opt_state=opt_state, step=state.step + 1, key=key, vision=vision
    )
    return new, Updated(batch=batch, metrics=metrics, health=health)
