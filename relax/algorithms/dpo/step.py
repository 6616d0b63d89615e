"""The DPO-family step: ``dpo_step = compose(reference, update)``, one jitted program.

- ``reference`` (jit, reads the reference): the reference model's sequence log-probs of both
  completions, ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[P]``, from one prefix-shared
  forward of ``state.ref`` per batch (forward only, one prompt group per pass where the passes
  say so), and ``ref_is_policy``. With ``cfg.precompute_reference`` they are the batch's own
  (``relax.algorithms.dpo.reference_cache``) and no reference model is read; SimPO and ORPO use
  none. While the reference is bitwise the policy, its forward is skipped (the entries are 0
  placeholders): the loss then takes the policy's own log-probs as the reference.
- ``update`` (jit): one optimizer step of ``make_dpo_loss`` through ``relax.train.update`` (its
  ``grad_accum`` micro-batches of pairs, ``pair_normalizers``), then ``step + 1`` and a new key, as
  GRPO's update does; adds ``metrics`` and ``health`` (``first_nonfinite_grad``,
  ``first_nonfinite``: an index of ``relax.train.health.QUANTITIES``, ``consecutive_skips``).

The batch (``collate``): ``prompt_ids``/``prompt_mask`` int32 ``[P, Lp]`` left-padded,
``tokens``/``mask`` int32 ``[P, 2, N]`` right-padded (0 chosen, 1 rejected), ``loss_mask`` ``[P]``
(1 per real pair; all ones when absent) and, with a precomputed reference,
``ref_chosen_logps``/``ref_rejected_logps`` float32 ``[P]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.compose import Stage, compose, stage
from relax.data.files import Record
from relax.data.pairs import Pair, collate_pairs, encode_pairs
from relax.models.prefix_shared import completion_rope
from relax.passes import Passes, choose_passes
from relax.text.base import TextTokenizer
from relax.train.health import QUANTITIES, first_nonfinite, step_health
from relax.train.state import TrainState, init_state, reference_is_policy, reference_model
from relax.train.update import LossContext, make_update

from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.loss import Forward, make_dpo_loss, pair_normalizers, sequence_logps, shared_forward

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
BATCH_KEYS = ("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask")


def encode(cfg: DPOConfig, records: Sequence[Record | Mapping[str, Any]], tokenizer: TextTokenizer) -> list[Pair]:
    """``relax.data.pairs.encode_pairs`` with the config's budgets and prompt truncation."""
    return encode_pairs(records, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                        max_completion_tokens=cfg.max_completion_tokens, truncate_prompt=cfg.truncate_prompt)


def collate(cfg: DPOConfig, pairs: Sequence[Pair], pad_id: int) -> dict:
    """A batch of fixed shape ``Lp = max_prompt_tokens``, ``N = max_completion_tokens``."""
    return collate_pairs(pairs, pad_id=pad_id, prompt_length=cfg.max_prompt_tokens,
                         completion_length=cfg.max_completion_tokens)


def make_state(cfg, policy, key: jax.Array) -> TrainState:
    """A fresh state with the config's optimizer, and a reference model (a copy of ``policy``)
    when the loss reads one and it is not precomputed (``cfg.needs_reference``). ``cfg``: a
    ``DPOConfig`` or a ``KTOConfig`` (the same rule)."""
    return init_state(policy, cfg.optimizer.make(), key=key, with_reference=cfg.needs_reference)


def eval_batches(examples: Sequence, batch_size: int, collate_fn: Callable[[list], dict]) -> list[tuple[dict, int]]:
    """``(batch, real rows)`` of ``examples`` in batches of one shape: the last is filled up with
    copies of its first example whose ``loss_mask`` is 0 (counted nowhere)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        real = len(chunk)
        batch = collate_fn(chunk + [chunk[0]] * (batch_size - real))
        batch["loss_mask"] = (np.arange(batch_size) < real).astype(np.int32)
        out.append((batch, real))
    return out


def evaluate(cfg: DPOConfig, state: TrainState, pairs: Sequence[Pair], *, pad_id: int, batch_size: int = 8,
             passes: Passes | None = None) -> dict[str, float]:
    """Held-out loss and metrics of ``state.policy`` on ``pairs`` (``make_dpo_eval`` over batches of
    ``batch_size``, one compile): every metric is a mean over pairs, so the batches' values are
    combined weighted by their real pairs (exact)."""
    if not pairs:
        return {}
    step = make_dpo_eval(cfg, passes)
    totals: dict[str, float] = {}
    for batch, real in eval_batches(pairs, batch_size, lambda c: collate(cfg, c, pad_id)):
        _, out = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        for k, v in out["metrics"].items():
            totals[k] = totals.get(k, 0.0) + real * float(v)
    return {k: v / len(pairs) for k, v in totals.items()}


def with_loss_mask(batch) -> dict:
    """The batch with ``loss_mask`` ``[P]`` (all ones: every row real) when it has none."""
    if "loss_mask" in batch:
        return batch
    return {**batch, "loss_mask": jnp.ones(batch["prompt_ids"].shape[:1], jnp.int32)}


def reference_logps(model, batch, forward: Forward) -> jax.Array:
    """``[P, 2]`` sequence log-probs (chosen, rejected) of ``model``, forward only."""
    sums, _ = sequence_logps(forward(model, batch, False), batch["mask"])
    return jax.lax.stop_gradient(sums)


def make_reference(cfg: DPOConfig, passes: Passes, forward: Forward) -> Stage:
    """The reference stage (module docstring)."""
    return make_pair_reference(passes, forward, REF_KEYS, enabled=cfg.uses_reference,
                               precompute=cfg.precompute_reference, reads_reference=cfg.needs_reference,
                               what=f"loss_type={cfg.loss_type!r}", cache="relax.algorithms.dpo.reference_cache")


def make_pair_reference(passes: Passes, forward: Forward, ref_keys: tuple[str, str], *, enabled: bool,
                        precompute: bool, reads_reference: bool, what: str, cache: str) -> Stage:
    """The reference log-probs of a batch's two completions per row (DPO: chosen / rejected; KTO:
    the completion / its KL completion) as ``ref_keys`` ``[P]`` each, and ``ref_is_policy``: read
    from the batch when ``precompute`` (attached by ``cache``), else one forward of the reference
    model, skipped (0 placeholders) while it is bitwise the policy. ``enabled=False``: the batch
    passes through (a reference-free loss)."""

    def reference(state: TrainState, batch):
        if not enabled:
            return state, batch
        if precompute:
            missing = [k for k in ref_keys if k not in batch]
            if missing:
                raise KeyError(f"precompute_reference=True but the batch has no {', '.join(missing)}: attach the "
                               f"cached reference log-probs ({cache})")
            return state, {**batch, "ref_is_policy": jnp.bool_(False)}
        ref_model = reference_model(state)
        if ref_model is None:
            raise ValueError(f"{what} needs a reference model, and state.ref is None "
                             "(init_state(..., with_reference=cfg.needs_reference), or precompute_reference)")
        same = reference_is_policy(state, smallest_first=passes.cache_sized)
        p = batch["prompt_ids"].shape[0]
        ref = jax.lax.cond(same, lambda: jnp.zeros((p, 2), jnp.float32),
                           lambda: reference_logps(ref_model, batch, forward).astype(jnp.float32))
        return state, {**batch, ref_keys[0]: ref[:, 0], ref_keys[1]: ref[:, 1], "ref_is_policy": same}

    return stage(reference, name="reference", updates_state=False, reads_reference=reads_reference)


def nonfinite_quantity(data, ref_is_policy, loss, ref_keys: Sequence[str]) -> jax.Array:
    """Index in ``QUANTITIES`` of the first non-finite one: the reference log-probs of real rows
    (when read), then the loss; -1 if none."""
    real = data["loss_mask"] > 0
    ref_bad = jnp.bool_(False)
    for k in ref_keys:
        ref_bad = ref_bad | jnp.any(real & ~jnp.isfinite(data[k]))
    ref_bad = ref_bad & ~jnp.asarray(ref_is_policy, bool)
    return jnp.where(ref_bad, QUANTITIES.index("ref_logprobs"), first_nonfinite({}, loss)).astype(jnp.int32)


def run_update(state: TrainState, batch, update_fn, data, *, checked, ref_keys: Sequence[str]) -> tuple[TrainState, dict]:
    """One ``update_fn`` on ``data`` (``relax.train.update``), then ``step + 1``, the new key and the
    batch's ``metrics`` / ``health`` (as GRPO's update); ``checked``: where the health check reads
    the reference log-probs ``ref_keys`` and ``loss_mask``."""
    ref_is_policy = batch.get("ref_is_policy", False)
    key, sub = jax.random.split(state.key)
    policy, opt_state, metrics = update_fn(state.policy, state.opt_state, data, sub, ref_is_policy)
    first_bad = nonfinite_quantity(checked, ref_is_policy, metrics["loss"], ref_keys)
    metrics, health = step_health(metrics, opt_state, first_bad)
    new = state.replace(policy=policy, opt_state=opt_state, step=state.step + 1, key=key)
    return new, {**batch, "metrics": metrics, "health": health}


def make_update_stage(cfg: DPOConfig, passes: Passes, forward: Forward | None = None) -> Stage:
    """One optimizer step of the DPO-family loss (``relax.train.update``)."""
    loss_fn = make_dpo_loss(cfg, passes, forward)
    ref_keys = REF_KEYS if cfg.uses_reference else ()

    def update(state: TrainState, batch):
        batch = with_loss_mask(batch)
        update_fn = make_update(loss_fn, state.optimizer, grad_accum=cfg.grad_accum, passes=passes,
                                normalizers=pair_normalizers, track_reference=cfg.needs_reference)
        data = {k: batch[k] for k in BATCH_KEYS + ref_keys}
        _, g, n = data["tokens"].shape  # rotary tables once, outside the micro-batch loop (completion_rope)
        data["rope"] = completion_rope(state.policy.config, data["prompt_mask"], g, n)
        return run_update(state, batch, update_fn, data, checked=data, ref_keys=ref_keys)

    return stage(update, name="update")


def make_dpo_step(cfg: DPOConfig, passes: Passes | None = None, *, forward: Forward | None = None) -> Stage:
    """``dpo_step(state, batch) -> (state, batch)`` (module docstring); the optimizer is the
    state's. ``passes``: the backend's pass layout (default ``choose_passes()``). ``forward``:
    replaces the prefix-shared forward (``relax.algorithms.dpo.loss.Forward``; benchmarks)."""
    passes = choose_passes() if passes is None else passes
    forward = forward or shared_forward(passes, attention=cfg.train_attention, remat=cfg.remat,
                                        remat_policy=cfg.remat_policy)
    return compose(make_reference(cfg, passes, forward), make_update_stage(cfg, passes, forward), name="dpo_step")


@functools.lru_cache(maxsize=8)
def make_dpo_eval(cfg: DPOConfig, passes: Passes | None = None) -> Stage:
    """``(state, batch) -> (state, batch + metrics)`` without an update: the loss (``loss``) and the
    training metrics of a held-out batch under the current policy, one forward, no gradient.
    Cached per ``(cfg, passes)``: every evaluation of a run reuses one compiled program."""
    passes = choose_passes() if passes is None else passes
    forward = shared_forward(passes, attention=cfg.train_attention)
    reference = make_reference(cfg, passes, forward)

    def evaluate(state: TrainState, batch):
        state, batch = reference.fn(state, with_loss_mask(batch))
        loss_fn = make_dpo_loss(cfg, passes, lambda m, mb, train: forward(m, mb, False))
        ctx = LossContext(pair_normalizers(batch), jnp.asarray(batch.get("ref_is_policy", False), bool))
        loss, metrics = loss_fn(state.policy, batch, ctx)
        return state, {**batch, "metrics": {"loss": loss, **{k: m.value for k, m in metrics.items()}}}

    return stage(evaluate, name="dpo_eval", updates_state=False, reads_reference=cfg.needs_reference)
