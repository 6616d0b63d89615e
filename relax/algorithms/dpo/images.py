"""The DPO family on prompts with images: the prefix-shared forward with each prompt's
``PromptInputs``, and the held-out evaluation of image pairs.

A pair's prompt holds its images; its chosen and rejected completions are text. The batch's
pixels go through the frozen vision tower once per prompt before the step
(``relax.models.vision.families.encode_images``: the ``PairBatch.prompt``), and every forward
(the reference's, the policy's) runs each prompt ONCE for both of its completions
(``relax.models.forward.prefix_shared.completion_logprobs(..., prompt=)``), the completions at
RoPE positions from the prompt's ``next_position`` (``completion_rope(..., prompt)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.preference.pairs import Forward, PairRows, shared_forward
from relax.data.image_prompts import ImageBatch
from relax.data.image_rows import ImagePair, ImagePairs
from relax.data.pairs import PairBatch
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import attention_probs_bytes
from relax.models.forward.prefix_shared import completion_logprobs
from relax.passes import Passes
from relax.train.update import forward_groups

# encode(prompt_ids, prompt_mask, images) -> the prompts' inputs, the vision tower run once per image
Encoder = Callable[[np.ndarray, np.ndarray, ImageBatch], PromptInputs]


class ImagePairRows(PairRows):
    """``PairRows`` whose prompts hold images: ``prompt``, their ``PromptInputs`` (every leaf
    ``[p, ...]``, sliced into micro-batches with the rows)."""

    prompt: PromptInputs | None = None


def prompt_of(rows) -> PromptInputs | None:
    """The image prompts' inputs of ``rows`` (an ``ImagePairRows`` or a ``PairBatch``), or None."""
    return rows.prompt if isinstance(rows, (ImagePairRows, PairBatch)) else None


def pair_forward(passes: Passes = Passes(), config: ForwardConfig = ForwardConfig()) -> Forward:
    """``shared_forward`` for text rows; for rows with images the same forward with their
    ``PromptInputs``: differentiated (``train``) with the rows' ``rope`` tables, or forward-only
    (a reference) one prompt group per pass."""
    text = shared_forward(passes, config)

    def forward(model, rows, train: bool):
        prompt = prompt_of(rows)
        if prompt is None:
            return text(model, rows, train)
        args = (model, rows.prompt_ids, rows.prompt_mask, rows.tokens, rows.mask)
        if not train:
            how = config.pass_(differentiated=False, groups_per_pass=forward_groups(passes, rows))
            return completion_logprobs(*args, how, prompt=prompt)
        probs_bytes = attention_probs_bytes(model.config, rows.prompt_ids, rows.tokens)
        how = config.pass_().laid_out(passes, model.config, probs_bytes)
        return completion_logprobs(*args, how, rope=rows.rope, prompt=prompt)

    return forward


def with_prompt(batch: ImagePairs, encode: Encoder) -> PairBatch:
    """The step's batch: the pairs with their prompts' ``PromptInputs`` (``encode``: the frozen
    vision tower once per prompt image), as device arrays."""
    pairs = jax.tree.map(jnp.asarray, batch.pairs)
    inputs = encode(batch.pairs.prompt_ids, batch.pairs.prompt_mask, batch.images)
    return PairBatch(
        prompt_ids=pairs.prompt_ids,
        prompt_mask=pairs.prompt_mask,
        tokens=pairs.tokens,
        mask=pairs.mask,
        loss_mask=pairs.loss_mask,
        ref_logps=pairs.ref_logps,
        ref_is_policy=pairs.ref_is_policy,
        margin=pairs.margin,
        prompt=inputs,
    )


def image_eval_batches(
    pairs: Sequence[ImagePair], batch_size: int, collate: Callable[[list], ImagePairs]
) -> list[tuple[ImagePairs, int]]:
    """``(batch, real pairs)`` in batches of ``batch_size`` (one compile): the last filled up
    with copies of its first pair whose ``loss_mask`` is 0 (counted nowhere)."""
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = list(pairs[start : start + batch_size])
        real = len(chunk)
        batch = collate(chunk + [chunk[0]] * (batch_size - real))
        loss_mask = (np.arange(batch_size) < real).astype(np.int32)
        pairs_ = dataclasses.replace(batch.pairs, loss_mask=loss_mask)
        out.append((batch._replace(pairs=pairs_), real))
    return out
