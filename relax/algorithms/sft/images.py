"""SFT on examples with images: the loss over whole left-padded sequences that hold their images,
and its step.

An example's images sit inside its sequence (a multi-turn chat may show one after an assistant
turn), so the example runs whole as one image prompt: its ``PromptInputs`` (the frozen vision
tower's features at the image tokens, Qwen2.5-VL's multimodal RoPE, Gemma 3's bidirectional
image blocks) are computed once per example from the batch's pixels before the step
(``relax.models.vision.families.encode_images``), and the language model runs over the sequence
with them (``relax.models.decoder.prompt_inputs.prompt_hidden_states``). Examples are not packed:
one per row, left-padded. The loss is the text SFT loss's (``relax.algorithms.sft.loss``)::

    loss = -sum_{t in targets} log p(ids[t] | ids[<t], images) / ctx.norms["tokens"]

targets: ``loss_mask[t] = 1`` with ``t - 1`` a token of the same row. Metrics: ``nll`` and
``accuracy`` (means over the micro-batch's targets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from relax.algorithms.offline.images import Encoder, ImageTrainer
from relax.algorithms.sft.config import SFTConfig
from relax.compose import Stage, compose, stage
from relax.data.image_prompts import ImagePrompts
from relax.data.image_rows import (
    ImageSFTBatch,
    ImageSFTExample,
    collate_image_sft,
    encode_sft_images,
)
from relax.masked import masked_mean
from relax.models.decoder.logprobs import DEFAULT_CHUNK, logprobs_from_hidden
from relax.models.decoder.prompt_inputs import PromptInputs, prompt_hidden_states
from relax.models.forward.packed import greedy_hits
from relax.models.vision.families import Pixels, pixels_of
from relax.passes import Passes, choose_passes
from relax.train.health import first_nonfinite, step_health
from relax.train.state import TrainState
from relax.train.update import LossContext, Updated, make_update, update_policy
from relax.train.vision_tower import ImageData, image_side

PROMPT_FEATURES = image_side("prompt")  # a trained tower's features: the rows' ``prompt``


class ImageSFTRows(eqx.Module):
    """An SFT batch with images as the step takes it: ``ids``, ``mask`` (1 at tokens) and
    ``loss_mask`` (1 where ``ids[t]`` is a target) int32 ``[r, t]``, left-padded, one example per
    row; ``prompt``: each row's inputs to the layers (``PromptInputs``, every leaf ``[r, ...]``);
    ``pixels``: the batch's images when the tower trains (``--train-vision``: the update
    recomputes ``prompt``'s features from them, ``relax.train.vision_tower``)."""

    ids: Int[Array, "r t"]
    mask: Int[Array, "r t"]
    loss_mask: Int[Array, "r t"]
    prompt: PromptInputs
    pixels: Pixels | None = None


def image_target_mask(rows: ImageSFTRows) -> Bool[Array, "r t-1"]:
    """Position ``t`` predicts a target ``ids[t+1]``: ``loss_mask[t+1] > 0`` and both tokens real."""
    return (rows.loss_mask[:, 1:] > 0) & (rows.mask[:, 1:] > 0) & (rows.mask[:, :-1] > 0)


def image_token_logprobs(
    policy, rows: ImageSFTRows, *, chunk_size: int = DEFAULT_CHUNK, remat: bool = False
):
    """``(log p(ids[t+1] | ids[<=t], images), hidden states)``, ``[r, t-1]`` and ``[r, t-1, D]``:
    the whole sequences run as image prompts (``remat``: each layer recomputed backward)."""
    h = prompt_hidden_states(policy, rows.ids, rows.mask, rows.prompt, remat=remat)[:, :-1]
    return logprobs_from_hidden(policy, h, rows.ids[:, 1:], chunk_size=chunk_size), h


def make_image_sft_loss(*, chunk_size: int = DEFAULT_CHUNK, remat: bool = False):
    """``loss(policy, rows, ctx) -> (scalar, metrics)`` on ``ImageSFTRows`` (module docstring);
    ``remat`` recomputes each layer in the backward pass."""

    def loss_fn(policy, mb: ImageSFTRows, ctx: LossContext):
        logp, h = image_token_logprobs(policy, mb, chunk_size=chunk_size, remat=remat)
        mask = image_target_mask(mb)
        nll = -jnp.where(mask, logp, 0.0)
        hits = greedy_hits(policy, h, mb.ids[:, 1:], chunk_size=chunk_size)
        return jnp.sum(nll) / ctx.norms["tokens"], {
            "nll": masked_mean(nll, mask),
            "accuracy": masked_mean(hits.astype(jnp.float32), mask),
        }

    return loss_fn


def check_image_sft(cfg: SFTConfig, batch_size: int) -> None:
    """What SFT on images does not do, refused by name: a batch that does not split into
    ``grad_accum`` micro-batches (image rows are not padded with empty ones)."""
    if batch_size % cfg.grad_accum:
        raise ValueError(
            f"--batch-size {batch_size}: SFT on images needs a multiple of "
            f"--sft.grad-accum {cfg.grad_accum} (image rows are not padded with empty rows)"
        )


def make_image_sft_step(cfg: SFTConfig, passes: Passes | None = None) -> Stage:
    """``step(state, rows) -> (state, Updated)``: one optimizer step of the image SFT loss on
    ``ImageSFTRows`` (``grad_accum`` micro-batches), then ``step + 1`` and a new key; metrics as
    the text step's (``loss``, ``nll``, ``accuracy``, ``grad_norm``, ``tokens``, ``loss_tokens``,
    ``padding_fraction``, ``skipped_updates``) and its ``health``. A state with a trained tower
    (``state.vision``) trains it too, its features recomputed inside the gradient."""
    passes = choose_passes() if passes is None else passes
    loss = make_image_sft_loss(remat=cfg.remat)

    def update(state: TrainState, batch: ImageSFTRows):
        rows, width = batch.ids.shape
        if width > cfg.max_length:
            raise ValueError(f"SFT rows of {width} tokens exceed max_length={cfg.max_length}")
        if rows % cfg.grad_accum:
            raise ValueError(f"{rows} image rows do not split into grad_accum={cfg.grad_accum}")
        tower = state.vision is not None
        update_fn = make_update(
            loss,
            state.optimizer,
            epochs=1,
            minibatches=1,
            grad_accum=cfg.grad_accum,
            passes=passes,
            side=PROMPT_FEATURES if tower else None,
        )
        key, sub = jax.random.split(state.key)
        rows = dataclasses.replace(batch, pixels=None)  # the update slices rows; images aside
        side_data = ImageData(batch.prompt, batch.pixels) if tower else None
        policy, vision, opt_state, metrics = update_policy(
            update_fn, state, rows, sub, False, side_data
        )
        metrics, health = step_health(metrics, opt_state, first_nonfinite(metrics["loss"]))
        metrics = {
            **metrics,
            "tokens": jnp.sum(batch.mask > 0).astype(jnp.int32),
            "loss_tokens": jnp.sum(image_target_mask(batch)).astype(jnp.int32),
            "padding_fraction": jnp.mean((batch.mask == 0).astype(jnp.float32)),
        }
        new = state.replace(
            policy=policy, opt_state=opt_state, step=state.step + 1, key=key, vision=vision
        )
        return new, Updated(batch=rows, metrics=metrics, health=health)

    return compose(stage(update, name="update"), name="sft_step")


def attach_prompt(batch: ImageSFTBatch, encode: Encoder, *, pixels: bool = False) -> ImageSFTRows:
    """The step's rows: the host batch on the device with each row's ``PromptInputs`` (the
    vision tower once per image of the batch); ``pixels``: with the images (a trained tower)."""
    return ImageSFTRows(
        jnp.asarray(batch.ids),
        jnp.asarray(batch.mask),
        jnp.asarray(batch.loss_mask),
        encode(batch.ids, batch.mask, batch.images),
        pixels_of(batch.images) if pixels else None,
    )


@jax.jit
def _nll(policy, rows: ImageSFTRows):
    logp, _ = image_token_logprobs(policy, rows)
    m = image_target_mask(rows)
    return -jnp.sum(jnp.where(m, logp, 0.0)), jnp.sum(m)


def image_held_out_nll(
    policy,
    examples: Sequence[ImageSFTExample],
    *,
    batch_size: int,
    length: int,
    pad_id: int,
    images: ImagePrompts,
    encode: Encoder,
) -> float:
    """Mean NLL per target of held-out examples with images, ``batch_size`` rows per forward (the
    last batch filled with copies of its first example that count nowhere: one compile)."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        fill = [dataclasses.replace(chunk[0], loss_mask=np.zeros_like(chunk[0].loss_mask))]
        batch = collate_image_sft(
            chunk + fill * (batch_size - len(chunk)), length=length, pad_id=pad_id, images=images
        )
        s, n = _nll(policy, attach_prompt(batch, encode))
        total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def image_sft_trainer(cfg: SFTConfig, images: ImagePrompts, *, batch_size: int) -> ImageTrainer:
    """SFT on rows with images (``relax.algorithms.offline.images``): examples from
    ``relax.data.image_rows``, one per row left-padded to ``max_length`` (not packed), the held-out
    NLL (``nll``)."""
    check_image_sft(cfg, batch_size)

    def encode(records, tokenizer):
        return encode_sft_images(
            records,
            tokenizer,
            images,
            max_length=cfg.max_length,
            messages_field=cfg.messages_field,
            prompt_field=cfg.prompt_field,
            completion_field=cfg.completion_field,
        )

    def evaluate(state, held_out, tokenizer, encoder):
        _, examples = held_out
        nll = image_held_out_nll(
            state.policy,
            examples,
            batch_size=batch_size,
            length=cfg.max_length,
            pad_id=tokenizer.pad_token_id,
            images=images,
            encode=encoder,
        )
        return {"nll": nll}

    return ImageTrainer(
        encode=encode,
        collate=lambda examples, pad_id: collate_image_sft(
            examples, length=cfg.max_length, pad_id=pad_id, images=images
        ),
        attach=attach_prompt,
        make_step=lambda passes, tokenizer: make_image_sft_step(cfg, passes),
        evaluate=evaluate,
        notes=(
            "rows with images: not packed (one example per row, left-padded to "
            f"--sft.max-length {cfg.max_length}); the vision tower run once per example",
            "held-out rows with images: NLL only (no greedy accuracy)",
        ),
    )
