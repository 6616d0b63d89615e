"""What an offline trainer brings to train on rows with images (``--image-field``): SFT and the
DPO family do (``relax.algorithms.sft.run``, ``relax.algorithms.dpo.run``); the others refuse
the flag.

The run (``relax.algorithms.offline.run``) loads the vision-language model (its language model
trains; the vision tower is frozen), builds the rows' ``ImagePrompts`` (the model's processor,
``--bad-images``) and hands them to ``OfflineAlgorithm.images``, which returns an
``ImageTrainer``: how rows become examples (``relax.data.image_rows``), examples a host batch
with its pixels, a host batch the step's batch (``attach``: the frozen vision tower run once per
prompt image by the run's ``Encoder``), the step, and the held-out evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from relax.data.files import Record
from relax.data.image_prompts import ImageBatch
from relax.data.image_rows import ImageRows
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.passes import Passes
from relax.text.base import TextTokenizer

# encode(prompt_ids, prompt_mask, images) -> the prompts' inputs, the vision tower once per image
Encoder = Callable[[np.ndarray, np.ndarray, ImageBatch], PromptInputs]


@dataclasses.dataclass(frozen=True)
class ImageTrainer:
    """An offline trainer on rows with images.

    ``encode(records, tokenizer)``: the examples and the rows dropped for a bad image
    (``ImageRows``; errors name the file, row and field). ``collate(examples, pad_id)``: a host
    batch with its pixels. ``attach(batch, encode)``: the step's batch, the prompts' inputs from
    ``encode``. ``make_step(passes, tokenizer)``: the step. ``evaluate(state, (records, rows),
    tokenizer, encode)``: held-out metrics. ``notes``: start-up report lines (what differs from
    the text trainer: no packing, figures not computed)."""

    encode: Callable[[Sequence[Record], TextTokenizer], ImageRows]
    collate: Callable[[list, int], Any]
    attach: Callable[[Any, Encoder], Any]
    make_step: Callable[[Passes, TextTokenizer], Any]
    evaluate: Callable[[Any, Any, TextTokenizer, Encoder], dict]
    notes: tuple[str, ...] = ()
