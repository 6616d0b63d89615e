"""The reference stage of the preference trainers (DPO family, KTO): the reference model's
sequence log-probs of each row's two completions, ``ref_logps`` ``[P, 2]`` in the order of
``tokens`` (DPO: chosen, rejected; KTO: the row's completion, its KL completion), and
``ref_is_policy``, on a ``relax.data.pairs.PairBatch`` or ``UnpairedBatch``.

Read from the batch when precomputed (``relax.algorithms.preference.reference_cache``), else one
forward-only pass of ``state.ref`` per batch, skipped while the reference is bitwise the policy:
``ref_logps`` are then 0 placeholders and ``ref_is_policy`` tells the loss to read the policy's
own log-probs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.algorithms.preference.pairs import Forward, sequence_logps
from relax.compose import Stage, stage
from relax.passes import Passes
from relax.train.state import TrainState, reference_is_policy, reference_model
from relax.train.vision_tower import tower_is_initial


def reference_logps(model, batch, forward: Forward) -> Float[Array, "p 2"]:
    """``[P, 2]`` sequence log-probs of ``batch``'s two completions per row under ``model``,
    forward only."""
    sums, _ = sequence_logps(forward(model, batch, False), batch.mask)
    return jax.lax.stop_gradient(sums)


def make_pair_reference(
    passes: Passes,
    forward: Forward,
    *,
    enabled: bool,
    precompute: bool,
    reads_reference: bool,
    what: str,
) -> Stage:
    """The reference stage (module docstring). ``enabled=False``: the batch passes through (a
    reference-free loss). ``precompute``: the batch's own ``ref_logps`` (attached from
    ``relax.algorithms.preference.reference_cache``; a batch without them is a ``KeyError``).
    ``what`` names the loss in the error raised
    when the state has no reference model."""

    def reference(state: TrainState, batch):
        if not enabled:
            return state, batch
        if precompute:
            if batch.ref_logps is None:
                raise KeyError(
                    "precompute_reference=True but the batch has no ref_logps: attach the cached "
                    "reference log-probs (relax.algorithms.preference.reference_cache)"
                )
            return state, dataclasses.replace(batch, ref_is_policy=jnp.bool_(False))
        ref_model = reference_model(state)
        if ref_model is None:
            raise ValueError(
                f"{what} needs a reference model, and state.ref is None "
                "(init_state(..., with_reference=cfg.needs_reference), or precompute_reference)"
            )
        same = reference_is_policy(state, smallest_first=passes.cache_sized) & tower_is_initial(
            state
        )  # a trained tower: the reference reads the initial one's features
        p = batch.prompt_ids.shape[0]
        ref = jax.lax.cond(
            same,
            lambda: jnp.zeros((p, 2), jnp.float32),
            lambda: reference_logps(ref_model, batch, forward).astype(jnp.float32),
        )
        return state, dataclasses.replace(batch, ref_logps=ref, ref_is_policy=same)

    return stage(reference, name="reference", updates_state=False, reads_reference=reads_reference)
