"""The KTO step: ``kto_step = compose(reference, reference_point, update)``, one jitted program.

- ``reference`` (jit, reads the reference): ``ref_logps`` / ``ref_kl_logps`` ``[P]``, the reference
  model's sequence log-probs of each example's completion (``tokens[:, 0]``) and of its mismatched
  KL completion (``tokens[:, 1]``), both from ONE prefix-shared forward of ``state.ref``; with
  ``cfg.precompute_reference`` the batch's own (``relax.algorithms.kto.reference_cache``). While
  the reference is bitwise the policy its forward is skipped (0 placeholders, ``ref_is_policy``).
- ``reference_point`` (jit): ``kl``, KTO's ``z0 = max(0, mean(pi(y'|x) - ref(y'|x)))`` over the
  batch's real examples (``relax.objectives.preference.kto_reference_point``), from a forward-only
  pass of the policy over the KL completions; 0 while the policy is the reference. Computed once
  per batch, before the update, so that every micro-batch sees the same ``z0`` (TRL computes it
  with the current policy under no gradient at the same step).
- ``update`` (jit): one optimizer step of ``make_kto_loss`` (the examples' own completions only),
  ``step + 1``, a new key, ``metrics`` and ``health`` as in ``relax.algorithms.dpo.step``.

The batch (``collate``, ``relax.data.pairs.collate_unpaired``): ``prompt_ids``/``prompt_mask``
``[P, Lp]``, ``tokens``/``mask`` ``[P, 2, N]``, ``loss_mask`` and ``label`` ``[P]``, and with a
precomputed reference ``ref_logps``/``ref_kl_logps`` ``[P]``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.compose import Stage, compose, stage
from relax.data.files import Record
from relax.data.pairs import Unpaired, collate_unpaired, encode_unpaired
from relax.models.prefix_shared import completion_rope
from relax.objectives.preference import kto_reference_point
from relax.passes import Passes, choose_passes
from relax.text.base import TextTokenizer
from relax.train.state import TrainState
from relax.train.update import LossContext, make_update

from relax.algorithms.dpo.loss import Forward, sequence_logps, shared_forward
from relax.algorithms.dpo.step import eval_batches, make_pair_reference, run_update, with_loss_mask
from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.kto.loss import kto_normalizers, make_kto_loss

REF_KEYS = ("ref_logps", "ref_kl_logps")


def encode(cfg: KTOConfig, records: Sequence[Record | Mapping[str, Any]], tokenizer: TextTokenizer) -> list[Unpaired]:
    """``relax.data.pairs.encode_unpaired`` with the config's budgets and prompt truncation."""
    return encode_unpaired(records, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                           max_completion_tokens=cfg.max_completion_tokens, truncate_prompt=cfg.truncate_prompt)


def collate(cfg: KTOConfig, examples: Sequence[Unpaired], pad_id: int) -> dict:
    """A batch of fixed shape ``Lp = max_prompt_tokens``, ``N = max_completion_tokens``."""
    return collate_unpaired(examples, pad_id=pad_id, prompt_length=cfg.max_prompt_tokens,
                            completion_length=cfg.max_completion_tokens)


def evaluate(cfg: KTOConfig, state: TrainState, examples: Sequence[Unpaired], *, pad_id: int, batch_size: int = 8,
             passes: Passes | None = None) -> dict[str, float]:
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
        _, out = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        d = int(np.sum(batch["label"][:real]))
        for k, v in out["metrics"].items():
            w = d if k.endswith("/chosen") else real - d if k.endswith("/rejected") else real
            totals[k] = totals.get(k, 0.0) + w * float(v)
            weights[k] = weights.get(k, 0.0) + w
    out = {k: totals[k] / weights[k] for k in totals if weights[k] > 0}
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def _own(batch, which: slice) -> dict:
    """The batch with only completions ``which`` of ``tokens`` / ``mask``."""
    return {**batch, "tokens": batch["tokens"][:, which], "mask": batch["mask"][:, which]}


def make_reference(cfg: KTOConfig, passes: Passes, forward: Forward) -> Stage:
    return make_pair_reference(passes, forward, REF_KEYS, enabled=True, precompute=cfg.precompute_reference,
                               reads_reference=cfg.needs_reference, what="KTO",
                               cache="relax.algorithms.kto.reference_cache")


def make_reference_point(passes: Passes, forward: Forward) -> Stage:
    def reference_point(state: TrainState, batch):
        batch = with_loss_mask(batch)
        same = jnp.asarray(batch.get("ref_is_policy", False), bool)

        def z0():
            policy_kl = sequence_logps(forward(state.policy, _own(batch, slice(1, 2)), False), batch["mask"][:, 1:])[0]
            return kto_reference_point(policy_kl[:, 0], batch["ref_kl_logps"].astype(jnp.float32),
                                       batch["loss_mask"] > 0)

        kl = jax.lax.stop_gradient(jax.lax.cond(same, lambda: jnp.float32(0.0), z0))
        return state, {**batch, "kl": kl}

    return stage(reference_point, name="reference_point", updates_state=False)


def make_update_stage(cfg: KTOConfig, passes: Passes, forward: Forward | None = None) -> Stage:
    loss_fn = make_kto_loss(cfg, passes, forward)

    def update(state: TrainState, batch):
        batch = with_loss_mask(batch)
        update_fn = make_update(loss_fn, state.optimizer, grad_accum=cfg.grad_accum, passes=passes,
                                normalizers=kto_normalizers, track_reference=cfg.needs_reference)
        own = _own(batch, slice(0, 1))
        p, g, n = own["tokens"].shape
        data = {k: own[k] for k in ("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask", "label", "ref_logps")}
        data["kl"] = jnp.broadcast_to(batch["kl"], (p,))
        data["rope"] = completion_rope(state.policy.config, data["prompt_mask"], g, n)
        return run_update(state, batch, update_fn, data, checked=batch, ref_keys=REF_KEYS)

    return stage(update, name="update")


def make_kto_step(cfg: KTOConfig, passes: Passes | None = None, *, forward: Forward | None = None) -> Stage:
    """``kto_step(state, batch) -> (state, batch)`` (module docstring); the optimizer is the state's."""
    passes = choose_passes() if passes is None else passes
    forward = forward or shared_forward(passes, attention=cfg.train_attention, remat=cfg.remat,
                                        remat_policy=cfg.remat_policy)
    return compose(make_reference(cfg, passes, forward), make_reference_point(passes, forward),
                   make_update_stage(cfg, passes, forward), name="kto_step")


@functools.lru_cache(maxsize=8)
def make_kto_eval(cfg: KTOConfig, passes: Passes | None = None) -> Stage:
    """``(state, batch) -> (state, batch + metrics)`` without an update: the KTO loss and metrics of a
    held-out batch under the current policy (forward only). Cached per ``(cfg, passes)``: every
    evaluation of a run reuses one compiled program."""
    passes = choose_passes() if passes is None else passes
    forward = shared_forward(passes, attention=cfg.train_attention)
    reference, point = make_reference(cfg, passes, forward), make_reference_point(passes, forward)

    def evaluate(state: TrainState, batch):
        state, batch = reference.fn(state, with_loss_mask(batch))
        state, batch = point.fn(state, batch)
        own = _own(batch, slice(0, 1))
        own["kl"] = jnp.broadcast_to(batch["kl"], own["label"].shape)
        loss_fn = make_kto_loss(cfg, passes, lambda m, mb, train: forward(m, mb, False))
        ctx = LossContext(kto_normalizers(batch), jnp.asarray(batch.get("ref_is_policy", False), bool))
        loss, metrics = loss_fn(state.policy, own, ctx)
        return state, {**batch, "metrics": {"loss": loss, **{k: m.value for k, m in metrics.items()}}}

    return stage(evaluate, name="kto_eval", updates_state=False, reads_reference=cfg.needs_reference)
