"""The DPO-family step: ``dpo_step = compose(reference, update)``, one jitted program.

- ``reference`` (jit, reads the reference; ``relax.algorithms.preference.reference``): the reference
  model's sequence log-probs of both completions, ``ref_logps`` ``[P, 2]``, from one prefix-shared
  forward of ``state.ref`` per batch (forward only, one prompt group per pass where the passes
  say so), and ``ref_is_policy``. With ``cfg.precompute_reference`` they are the batch's own
  (``relax.algorithms.preference.reference_cache``) and no reference model is read; SimPO and ORPO use
  none. While the reference is bitwise the policy, its forward is skipped (0 placeholders): the
  loss then takes the policy's own log-probs as the reference.
- ``update`` (jit): one optimizer step of ``make_dpo_loss`` through ``relax.train.update`` (its
  ``grad_accum`` micro-batches of pairs, ``pair_normalizers``), then ``step + 1`` and a new key, as
  GRPO's update does; its output is ``relax.train.update.Updated``: the batch, ``metrics`` and
  ``health`` (``first_nonfinite_grad``, ``first_nonfinite``: an index of
  ``relax.train.health.QUANTITIES``, ``consecutive_skips``).

The batch is a ``relax.data.pairs.PairBatch`` (``collate``): ``prompt_ids``/``prompt_mask`` int32
``[P, Lp]`` left-padded, ``tokens``/``mask`` int32 ``[P, 2, N]`` right-padded (0 chosen, 1
rejected), ``loss_mask`` ``[P]`` (1 per real pair; all ones when None) and, with a precomputed
reference, ``ref_logps`` float32 ``[P, 2]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.images import (
    Encoder,
    ImagePairRows,
    image_eval_batches,
    pair_forward,
    with_prompt,
)
from relax.algorithms.dpo.loss import make_dpo_loss, pair_normalizers
from relax.algorithms.offline.held_out import eval_batches
from relax.algorithms.preference.pairs import Forward, PairRows
from relax.algorithms.preference.reference import make_pair_reference
from relax.algorithms.preference.update import ref_is_policy_of, run_update, with_loss_mask
from relax.compose import Stage, compose, stage
from relax.data.files import Record
from relax.data.image_prompts import ImagePrompts
from relax.data.image_rows import ImagePair, ImagePairs, collate_image_pairs
from relax.data.pairs import Pair, PairBatch, collate_pairs, encode_pairs
from relax.models.forward.prefix_shared import completion_rope
from relax.passes import Passes, choose_passes
from relax.text.base import TextTokenizer
from relax.train.state import TrainState
from relax.train.update import LossContext, Updated, make_update
from relax.train.vision_tower import ImageData, image_side

PROMPT_FEATURES = image_side("prompt")  # a trained tower's features: the rows' ``prompt``


def encode(
    cfg: DPOConfig, records: Sequence[Record | Mapping[str, Any]], tokenizer: TextTokenizer
) -> list[Pair]:
    """``relax.data.pairs.encode_pairs`` with the config's budgets and prompt truncation."""
    return encode_pairs(
        records,
        tokenizer,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_completion_tokens=cfg.max_completion_tokens,
        truncate_prompt=cfg.truncate_prompt,
    )


def collate(cfg: DPOConfig, pairs: Sequence[Pair], pad_id: int) -> PairBatch:
    """A batch of fixed shape ``Lp = max_prompt_tokens``, ``N = max_completion_tokens``."""
    return collate_pairs(
        pairs,
        pad_id=pad_id,
        prompt_length=cfg.max_prompt_tokens,
        completion_length=cfg.max_completion_tokens,
    )


def collate_images(
    cfg: DPOConfig, pairs: Sequence[ImagePair], pad_id: int, images: ImagePrompts
) -> ImagePairs:
    """``collate`` of pairs whose prompts hold images, with the batch's pixels."""
    return collate_image_pairs(
        pairs,
        pad_id=pad_id,
        prompt_length=cfg.max_prompt_tokens,
        completion_length=cfg.max_completion_tokens,
        images=images,
    )


def evaluate(
    cfg: DPOConfig,
    state: TrainState,
    pairs: Sequence[Pair] | Sequence[ImagePair],
    *,
    pad_id: int,
    batch_size: int = 8,
    passes: Passes | None = None,
    images: ImagePrompts | None = None,
    encode: Encoder | None = None,
) -> dict[str, float]:
    """Held-out loss and metrics of ``state.policy`` on ``pairs`` (``make_dpo_eval`` over batches of
    ``batch_size``, one compile): every metric is a mean over pairs, so the batches' values are
    combined weighted by their real pairs (exact). Pairs with images (``ImagePair``) need their
    ``images`` and an ``encode`` (``relax.algorithms.dpo.images.Encoder``)."""
    if not pairs:
        return {}
    step = make_dpo_eval(cfg, passes)
    if images is None:
        batches = [
            (jax.tree.map(jnp.asarray, b), real)
            for b, real in eval_batches(pairs, batch_size, lambda c: collate(cfg, c, pad_id))
        ]
    else:
        collate_ = lambda c: collate_images(cfg, c, pad_id, images)  # noqa: E731
        batches = [
            (with_prompt(b, encode), real)
            for b, real in image_eval_batches(pairs, batch_size, collate_)
        ]
    totals: dict[str, float] = {}
    for batch, real in batches:
        _, out = step(state, batch)
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + real * float(v)
    return {k: v / len(pairs) for k, v in totals.items()}


def make_reference(cfg: DPOConfig, passes: Passes, forward: Forward) -> Stage:
    """The reference stage (module docstring)."""
    return make_pair_reference(
        passes,
        forward,
        enabled=cfg.uses_reference,
        precompute=cfg.precompute_reference,
        reads_reference=cfg.needs_reference,
        what=f"loss_type={cfg.loss_type!r}",
    )


def pair_rows(cfg: DPOConfig, batch: PairBatch, rope=None) -> PairRows:
    """What the loss reads of a batch with its ``loss_mask``: the pairs, and their reference
    log-probs when the loss uses them; an ``ImagePairRows`` with the prompts' inputs when they
    hold images."""
    fields = dict(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        tokens=batch.tokens,
        mask=batch.mask,
        loss_mask=batch.loss_mask,
        ref_logps=batch.ref_logps if cfg.uses_reference else None,
        rope=rope,
    )
    if batch.prompt is None:
        return PairRows(**fields)
    return ImagePairRows(**fields, prompt=batch.prompt)


def make_update_stage(cfg: DPOConfig, passes: Passes, forward: Forward | None = None) -> Stage:
    """One optimizer step of the DPO-family loss (``relax.train.update``)."""
    loss_fn = make_dpo_loss(cfg, passes, forward)

    def update(state: TrainState, batch: PairBatch):
        batch = with_loss_mask(batch)
        tower = state.vision is not None  # a trained tower: its features in the gradient
        update_fn = make_update(
            loss_fn,
            state.optimizer,
            grad_accum=cfg.grad_accum,
            passes=passes,
            normalizers=pair_normalizers,
            track_reference=cfg.needs_reference,
            side=PROMPT_FEATURES if tower else None,
        )
        _, g, n = batch.tokens.shape  # rotary tables once, outside the micro-batch loop
        rope = completion_rope(state.policy.config, batch.prompt_mask, g, n, batch.prompt)
        rows = pair_rows(cfg, batch, rope)
        side_data = ImageData(batch.prompt, batch.pixels) if tower else None
        batch = dataclasses.replace(batch, pixels=None)  # the output keeps no images
        return run_update(
            state, batch, update_fn, rows, ref_logps=rows.ref_logps, side_data=side_data
        )

    return stage(update, name="update")


def make_dpo_step(
    cfg: DPOConfig, passes: Passes | None = None, *, forward: Forward | None = None
) -> Stage:
    """``dpo_step(state, batch) -> (state, Updated)`` (module docstring); the optimizer is the
    state's. ``passes``: the backend's pass layout (default ``choose_passes()``). ``forward``:
    replaces the prefix-shared forward (``relax.algorithms.preference.pairs.Forward``; benchmarks).

    Args:
        cfg: the DPO-family config (``DPOConfig``): the loss and its options, the reference
            (``precompute_reference``), ``grad_accum`` and the forward options.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.
        forward: ``forward(model, rows, train) -> [p g n]`` token log-probs of ``rows.tokens``.
            None: ``pair_forward(passes, cfg.forward)`` (``shared_forward``, with the prompts'
            ``PromptInputs`` for a batch whose prompts hold images).

    Returns:
        A ``Stage`` named ``"dpo_step"``, one jitted program: ``batch`` is a ``PairBatch`` (module
            docstring); ``state`` is a ``TrainState`` with a reference model when
            ``cfg.needs_reference`` (``relax.algorithms.preference.config.make_state``), returned
            after one optimizer step with ``step + 1`` and a new key. The ``Updated`` holds the
            batch (with its ``loss_mask`` and, for a loss with a reference, ``ref_logps`` and
            ``ref_is_policy`` set), ``metrics`` (the loss's, ``loss``, ``grad_norm``,
            ``skipped_updates``) and ``health``.
    """
    passes = choose_passes() if passes is None else passes
    forward = forward or pair_forward(passes, cfg.forward)
    return compose(
        make_reference(cfg, passes, forward),
        make_update_stage(cfg, passes, forward),
        name="dpo_step",
    )


@functools.lru_cache(maxsize=8)
def make_dpo_eval(cfg: DPOConfig, passes: Passes | None = None) -> Stage:
    """``(state, batch) -> (state, Updated)`` without an update: the loss (``loss``) and the
    training metrics of a held-out batch under the current policy, one forward, no gradient, in
    ``Updated.metrics`` (``health`` empty). Cached per ``(cfg, passes)``: every evaluation of a
    run reuses one compiled program."""
    passes = choose_passes() if passes is None else passes
    forward = pair_forward(passes, cfg.forward)
    reference = make_reference(cfg, passes, forward)

    def evaluate(state: TrainState, batch: PairBatch):
        state, batch = reference.fn(state, with_loss_mask(batch))
        loss_fn = make_dpo_loss(cfg, passes, lambda m, mb, train: forward(m, mb, False))
        rows = pair_rows(cfg, batch)
        loss, metrics = loss_fn(
            state.policy, rows, LossContext(pair_normalizers(rows), ref_is_policy_of(batch))
        )
        return state, Updated(
            batch=batch,
            metrics={"loss": loss, **{k: m.value for k, m in metrics.items()}},
            health={},
        )

    return stage(
        evaluate, name="dpo_eval", updates_state=False, reads_reference=cfg.needs_reference
    )
