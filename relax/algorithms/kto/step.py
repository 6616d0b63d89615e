"""The KTO step: ``kto_step = compose(reference, reference_point, update)``, one jitted program.

- ``reference`` (jit, reads the reference; ``relax.algorithms.preference.reference``): ``ref_logps``
  ``[P, 2]``, the reference model's sequence log-probs of each example's completion
  (``tokens[:, 0]``) and of its mismatched KL completion (``tokens[:, 1]``), both from ONE
  prefix-shared forward of ``state.ref``; with ``cfg.precompute_reference`` the batch's own
  (``relax.algorithms.preference.reference_cache``). While the reference is bitwise the policy its
  forward is skipped (0 placeholders, ``ref_is_policy``).
- ``reference_point`` (jit): ``kl``, KTO's ``z0 = max(0, mean(pi(y'|x) - ref(y'|x)))`` over the
  batch's real examples (``relax.objectives.preference.kto_reference_point``), from a forward-only
  pass of the policy over the KL completions; 0 while the policy is the reference. Computed once
  per batch, before the update, so that every micro-batch sees the same ``z0`` (TRL computes it
  with the current policy under no gradient at the same step).
- ``update`` (jit): one optimizer step of ``make_kto_loss`` (the examples' own completions only),
  ``step + 1``, a new key; its output is ``relax.train.update.Updated`` (the batch, ``metrics``,
  ``health``) as in ``relax.algorithms.dpo.step``.

The batch is a ``relax.data.pairs.UnpairedBatch`` (``collate``): ``prompt_ids``/``prompt_mask``
``[P, Lp]``, ``tokens``/``mask`` ``[P, 2, N]``, ``loss_mask`` and ``label`` ``[P]``, and with a
precomputed reference ``ref_logps`` ``[P, 2]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.kto.loss import kto_normalizers, make_kto_loss
from relax.algorithms.offline.held_out import eval_batches
from relax.algorithms.preference.pairs import Forward, PairRows, sequence_logps, shared_forward
from relax.algorithms.preference.reference import make_pair_reference
from relax.algorithms.preference.update import ref_is_policy_of, run_update, with_loss_mask
from relax.compose import Stage, compose, stage
from relax.data.files import Record
from relax.data.pairs import Unpaired, UnpairedBatch, collate_unpaired, encode_unpaired
from relax.models.forward.prefix_shared import completion_rope
from relax.objectives.preference import kto_reference_point
from relax.passes import Passes, choose_passes
from relax.text.base import TextTokenizer
from relax.train.state import TrainState
from relax.train.update import LossContext, Updated, make_update


def encode(
    cfg: KTOConfig, records: Sequence[Record | Mapping[str, Any]], tokenizer: TextTokenizer
) -> list[Unpaired]:
    """``relax.data.pairs.encode_unpaired`` with the config's budgets and prompt truncation."""
    return encode_unpaired(
        records,
        tokenizer,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_completion_tokens=cfg.max_completion_tokens,
        truncate_prompt=cfg.truncate_prompt,
    )


def collate(cfg: KTOConfig, examples: Sequence[Unpaired], pad_id: int) -> UnpairedBatch:
    """A batch of fixed shape ``Lp = max_prompt_tokens``, ``N = max_completion_tokens``."""
    return collate_unpaired(
        examples,
        pad_id=pad_id,
        prompt_length=cfg.max_prompt_tokens,
        completion_length=cfg.max_completion_tokens,
    )


def evaluate(
    cfg: KTOConfig,
    state: TrainState,
    examples: Sequence[Unpaired],
    *,
    pad_id: int,
    batch_size: int = 8,
    passes: Passes | None = None,
) -> dict[str, float]:
    """Held-out KTO loss and metrics of ``state.policy`` (``make_kto_eval`` over batches of
    ``batch_size``; ``z0`` per batch, as in training): the loss, ``kl`` and ``rewards/margins`` are
    weighted by each batch's examples, the ``*/chosen`` / ``*/rejected`` means by its desirable /
    undesirable ones."""
    if not examples:
        return {}
    step = make_kto_eval(cfg, passes)
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for batch, real in eval_batches(examples, batch_size, lambda c: collate(cfg, c, pad_id)):
        _, out = step(state, jax.tree.map(jnp.asarray, batch))
        d = int(np.sum(batch.label[:real]))
        for k, v in out.metrics.items():
            w = d if k.endswith("/chosen") else real - d if k.endswith("/rejected") else real
            totals[k] = totals.get(k, 0.0) + w * float(v)
            weights[k] = weights.get(k, 0.0) + w
    out = {k: totals[k] / weights[k] for k in totals if weights[k] > 0}
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def own_rows(batch: UnpairedBatch, rope=None) -> PairRows:
    """What the loss reads of a batch with its ``loss_mask`` and ``kl``: each example's own
    completion (``tokens[:, :1]``), its label and reference log-prob, and ``z0`` repeated per row."""
    p, _, n = batch.tokens.shape
    return PairRows(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        tokens=batch.tokens[:, :1],
        mask=batch.mask[:, :1],
        loss_mask=batch.loss_mask,
        label=batch.label,
        ref_logps=batch.ref_logps[:, :1],
        kl=jnp.broadcast_to(batch.kl, (p,)),
        rope=rope,
    )


def make_reference(cfg: KTOConfig, passes: Passes, forward: Forward) -> Stage:
    return make_pair_reference(
        passes,
        forward,
        enabled=True,
        precompute=cfg.precompute_reference,
        reads_reference=cfg.needs_reference,
        what="KTO",
    )


def make_reference_point(passes: Passes, forward: Forward) -> Stage:
    def reference_point(state: TrainState, batch: UnpairedBatch):
        batch = with_loss_mask(batch)

        def z0():
            kl_rows = PairRows(
                prompt_ids=batch.prompt_ids,
                prompt_mask=batch.prompt_mask,
                tokens=batch.tokens[:, 1:2],
                mask=batch.mask[:, 1:2],
                loss_mask=batch.loss_mask,
            )
            policy_kl = sequence_logps(forward(state.policy, kl_rows, False), kl_rows.mask)[0]
            return kto_reference_point(
                policy_kl[:, 0], batch.ref_logps[:, 1].astype(jnp.float32), batch.loss_mask > 0
            )

        # a select, not a lax.cond: a cond around the forward's collectives hung two CPU
        # processes (gloo) at the first step whose reference differs from the policy
        kl = jax.lax.stop_gradient(jnp.where(ref_is_policy_of(batch), jnp.float32(0.0), z0()))
        return state, dataclasses.replace(batch, kl=kl)

    return stage(reference_point, name="reference_point", updates_state=False)


def make_update_stage(cfg: KTOConfig, passes: Passes, forward: Forward | None = None) -> Stage:
    loss_fn = make_kto_loss(cfg, passes, forward)

    def update(state: TrainState, batch: UnpairedBatch):
        batch = with_loss_mask(batch)
        update_fn = make_update(
            loss_fn,
            state.optimizer,
            grad_accum=cfg.grad_accum,
            passes=passes,
            normalizers=kto_normalizers,
            track_reference=cfg.needs_reference,
        )
        _, _, n = batch.tokens.shape
        rows = own_rows(batch, completion_rope(state.policy.config, batch.prompt_mask, 1, n))
        return run_update(state, batch, update_fn, rows, ref_logps=batch.ref_logps)

    return stage(update, name="update")


def make_kto_step(
    cfg: KTOConfig, passes: Passes | None = None, *, forward: Forward | None = None
) -> Stage:
    """``kto_step(state, batch) -> (state, Updated)`` (module docstring); the optimizer is the
    state's.

    Args:
        cfg: the KTO config (``KTOConfig``): ``beta``, the desirable / undesirable weights, the
            reference (``precompute_reference``), ``grad_accum`` and the forward options.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.
        forward: ``forward(model, rows, train) -> [p g n]`` token log-probs of ``rows.tokens``.
            None: ``shared_forward(passes, cfg.forward)``.

    Returns:
        A ``Stage`` named ``"kto_step"``, one jitted program: ``batch`` is an ``UnpairedBatch``
            (module docstring); ``state`` is a ``TrainState`` with a reference model unless
            ``cfg.precompute_reference`` (``relax.algorithms.preference.config.make_state``),
            returned after one optimizer step with ``step + 1`` and a new key. The ``Updated`` holds
            the batch with its ``loss_mask``, ``ref_logps``, ``ref_is_policy`` and ``kl`` set,
            ``metrics`` (the loss's, ``loss``, ``grad_norm``, ``skipped_updates``) and ``health``.
    """
    passes = choose_passes() if passes is None else passes
    forward = forward or shared_forward(passes, cfg.forward)
    return compose(
        make_reference(cfg, passes, forward),
        make_reference_point(passes, forward),
        make_update_stage(cfg, passes, forward),
        name="kto_step",
    )


@functools.lru_cache(maxsize=8)
def make_kto_eval(cfg: KTOConfig, passes: Passes | None = None) -> Stage:
    """``(state, batch) -> (state, Updated)`` without an update: the KTO loss and metrics of a
    held-out batch under the current policy (forward only), in ``Updated.metrics`` (``health``
    empty). Cached per ``(cfg, passes)``: every evaluation of a run reuses one compiled program."""
    passes = choose_passes() if passes is None else passes
    forward = shared_forward(passes, cfg.forward)
    reference, point = make_reference(cfg, passes, forward), make_reference_point(passes, forward)

    def evaluate(state: TrainState, batch: UnpairedBatch):
        state, batch = reference.fn(state, with_loss_mask(batch))
        state, batch = point.fn(state, batch)
        loss_fn = make_kto_loss(cfg, passes, lambda m, mb, train: forward(m, mb, False))
        ctx = LossContext(kto_normalizers(batch), ref_is_policy_of(batch))
        loss, metrics = loss_fn(state.policy, own_rows(batch), ctx)
        return state, Updated(
            batch=batch,
            metrics={"loss": loss, **{k: m.value for k, m in metrics.items()}},
            health={},
        )

    return stage(
        evaluate, name="kto_eval", updates_state=False, reads_reference=cfg.needs_reference
    )
