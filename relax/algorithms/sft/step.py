"""The SFT step: one stage, ``update``, over a batch of packed (or padded) supervised rows.

    sft_step = compose(update)        # jit: the generic update of the SFT loss, then step + 1

The batch is a ``relax.data.supervised.PackedBatch`` (int32 ``[rows, T]`` ``ids``,
``segment_ids``, ``loss_mask``): a batch of examples packed or padded (``sft_batch``, by
``SFTConfig.packing``), or ``stack_rows`` of rows of a dataset packed once (``sft_rows``).
The update is ``relax.train.update.make_update`` with one epoch, one minibatch and
``grad_accum`` micro-batches; the rows are padded with empty rows up to a multiple of
``grad_accum`` (empty rows add nothing to the loss or its gradient). The output is a
``relax.train.update.Updated``: the batch, ``metrics`` (the update's ``loss``, ``nll``,
``accuracy``, ``grad_norm``, plus ``tokens``: the tokens of the batch, ``loss_tokens``: its
targets, ``padding_fraction``: the share of processed positions holding no token,
``skipped_updates``) and ``health`` (the keys of GRPO's: ``first_nonfinite_grad``,
``first_nonfinite``, ``consecutive_skips``; see ``relax.train.health``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from relax.algorithms.sft.config import SFTConfig
from relax.algorithms.sft.loss import make_sft_loss
from relax.compose import Stage, compose, stage
from relax.data.files import Record
from relax.data.supervised import (
    PackedBatch,
    SFTExample,
    encode_sft,
    pack,
    pack_rows,
    pad_rows,
)
from relax.passes import Passes, choose_passes
from relax.text.base import TextTokenizer
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState, init_state
from relax.train.update import Updated, make_update


def sft_examples(
    cfg: SFTConfig, records: Sequence[Record | Mapping[str, Any]], tokenizer: TextTokenizer
) -> list[SFTExample]:
    """The records as ``SFTExample``s under the config's columns, ``max_length`` and ``truncate``."""
    return encode_sft(
        records,
        tokenizer,
        max_length=cfg.max_length,
        truncate=cfg.truncate,
        messages_field=cfg.messages_field,
        prompt_field=cfg.prompt_field,
        completion_field=cfg.completion_field,
        text_field=cfg.text_field,
    )


def sft_batch(
    cfg: SFTConfig, examples: Sequence[SFTExample], *, pad_id: int, num_rows: int | None = None
) -> PackedBatch:
    """One batch of rows of ``max_length`` tokens: packed (``cfg.packing``, by ``cfg.pack_method``)
    or one example per row; ``num_rows`` fixes the row count (``relax.data.supervised``)."""
    if cfg.packing:
        return pack(
            examples, cfg.max_length, pad_id=pad_id, method=cfg.pack_method, num_rows=num_rows
        )
    return pad_rows(examples, cfg.max_length, pad_id=pad_id, num_rows=num_rows)


def sft_rows(cfg: SFTConfig, examples: Sequence[SFTExample], *, pad_id: int) -> list[PackedBatch]:
    """A whole dataset as rows of ``max_length`` tokens (each a ``PackedBatch`` of one row), packed
    (``cfg.packing``, by ``cfg.pack_method``) or one example per row; a batch is ``stack_rows`` of
    ``batch_size`` of them."""
    return pack_rows(
        examples, cfg.max_length, pad_id=pad_id, method=cfg.pack_method, packing=cfg.packing
    )


def init_sft_state(cfg: SFTConfig, policy, *, key: jax.Array) -> TrainState:
    """A ``TrainState`` for SFT: the policy and ``cfg.optimizer``; no reference model.

    Args:
        cfg: the SFT config; ``cfg.optimizer.make()`` is the state's optimizer.
        policy: the model to train (a ``Transformer``, with or without LoRA adapters: with them
            only the adapters train).
        key: the PRNG key the steps split.

    Returns:
        A fresh ``TrainState``: ``policy``, its optimizer state, ``step`` 0 and ``key``.
    """
    return init_state(policy, cfg.optimizer.make(), key=key)


def _pad_to_multiple(data: PackedBatch, rows: int, multiple: int) -> PackedBatch:
    extra = (-rows) % multiple
    if not extra:
        return data
    return jax.tree.map(lambda v: jnp.pad(v, ((0, extra),) + ((0, 0),) * (v.ndim - 1)), data)


def make_update_stage(cfg: SFTConfig, passes: Passes) -> Stage:
    """The generic update of the SFT loss on ``state.policy``, then ``step + 1`` and a new key."""
    loss = make_sft_loss(remat=cfg.remat, moe=cfg.moe, block=passes.rows_block())

    def update(state: TrainState, batch: PackedBatch):
        data = jax.tree.map(jnp.asarray, batch)
        rows, width = data.ids.shape
        if width > cfg.max_length:
            raise ValueError(f"SFT rows of {width} tokens exceed max_length={cfg.max_length}")
        data = _pad_to_multiple(data, rows, cfg.grad_accum)
        update_fn = make_update(
            loss, state.optimizer, epochs=1, minibatches=1, grad_accum=cfg.grad_accum, passes=passes
        )
        key, sub = jax.random.split(state.key)
        policy, opt_state, metrics = update_fn(state.policy, state.opt_state, data, sub)
        metrics, health = step_health(metrics, opt_state, first_nonfinite(metrics["loss"]))
        seg = data.segment_ids
        metrics = {
            **metrics,
            "tokens": jnp.sum(seg > 0).astype(jnp.int32),
            "loss_tokens": jnp.sum(data.loss_mask > 0).astype(jnp.int32),
            "padding_fraction": jnp.mean((seg == 0).astype(jnp.float32)),
        }
        new = state.replace(policy=policy, opt_state=opt_state, step=state.step + 1, key=key)
        return new, Updated(batch=batch, metrics=metrics, health=health)

    return stage(update, name="update")


def make_sft_step(cfg: SFTConfig, passes: Passes | None = None) -> Stage:
    """``sft_step(state, batch) -> (state, Updated)`` (module docstring); the optimizer is the
    state's (``init_sft_state``). ``passes``: the backend's pass layout (default
    ``choose_passes()``).

    Args:
        cfg: the SFT config: ``max_length`` (the longest row allowed), ``grad_accum``, ``remat``
            and ``moe`` are read here.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.

    Returns:
        A ``Stage`` named ``"sft_step"``, one jitted program: ``batch`` is a ``PackedBatch`` (int32
            ``[rows t]`` ``ids``, ``segment_ids``, ``loss_mask``, ``t <= cfg.max_length``);
            ``state`` comes back after one optimizer step, with ``step + 1`` and a new key. The
            ``Updated`` holds the batch as given, ``metrics`` and ``health`` (module docstring).
    """
    passes = choose_passes() if passes is None else passes
    return compose(make_update_stage(cfg, passes), name="sft_step")
