"""The distillation batch (``DistillBatch``): prompts and, off-policy, the dataset's completions
(``collate_completions``); the step fills in what it samples and what the teacher computes."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from relax.data.pairs import right_pad
from relax.models.forward.prefix_shared import CompletionRope
from relax.text.sentencepiece_model import pad_left


class DistillBatch(eqx.Module):
    """Prompt groups of a distillation step (``relax.algorithms.distill.step``).

    ``prompt_ids`` / ``prompt_mask``: the prompts, left-padded to ``lp``. ``tokens`` / ``mask``: ``g``
    completions per prompt right after it, right-padded to ``n``: the dataset's
    (``collate_completions``) or sampled from the student (the ``sample`` stage; None: an
    on-policy batch before sampling).
    ``loss_mask``: the completion tokens the loss counts (None: ``mask``'s). ``lengths`` /
    ``finished``: sampled tokens per completion and whether it ended before the budget (set by
    ``sample``). ``on_policy``: whether this step's completions are the student's samples (set by
    ``sample``). ``teacher_hidden``: the teacher's final-norm hidden states predicting each
    completion token (set by the ``teacher`` stage). ``rope``: the student's rotary tables of the
    update's forward, computed once outside the micro-batch loop (``completion_rope``).
    """

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p g n"] | None = None
    mask: Int[Array, "p g n"] | None = None
    loss_mask: Int[Array, "p g n"] | None = None
    lengths: Int[Array, "p g"] | None = None
    finished: Bool[Array, "p g"] | None = None
    on_policy: Bool[Array, ""] | None = None
    teacher_hidden: Float[Array, "p g n d"] | None = None
    rope: CompletionRope | None = None


def collate_completions(
    examples: Sequence[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    prompt_length: int,
    completion_length: int,
) -> DistillBatch:
    """``(prompt, completion)`` token lists as a batch of one completion per prompt (``g = 1``):
    prompts left-padded to ``prompt_length``, completions right-padded to ``completion_length``."""
    prompt_ids, prompt_mask = pad_left(
        [p for p, _ in examples], pad_id=pad_id, length=prompt_length
    )
    tokens, mask = right_pad([c for _, c in examples], completion_length, pad_id)
    return DistillBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens[:, None], mask=mask[:, None]
    )
