"""Supervised fine-tuning configuration: data columns, batching (packing), the update and its
optimizer. Every field is read by the trainer (``relax.algorithms.sft.step``)."""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.data.supervised import PACK_METHODS
from relax.models.moe.experts import MoEConfig
from relax.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning.

    Data: examples of at most ``max_length`` tokens (longer ones are an error unless
    ``truncate``: then cut from the end, ``relax.data.supervised``), read from the columns
    ``messages_field`` (a chat: loss on the assistant turns), ``prompt_field`` +
    ``completion_field`` (loss on the completion) or ``text_field`` (loss on every token).
    Batches: with ``packing``, whole examples share rows of ``max_length`` tokens
    (``pack_method``: ``"ffd"`` first-fit-decreasing or ``"greedy"`` in order), attention kept
    within each example; without, one example per row, right-padded to ``max_length``.
    Update: ``grad_accum`` micro-batches per optimizer step (the loss does not depend on it),
    ``remat`` recomputes each layer in the backward pass (on by default, as TRL's
    ``gradient_checkpointing``: a step's rows of ``max_length`` tokens keep one layer's
    activations instead of all of them; ``--sft.no-remat`` trades that memory for a third less
    arithmetic), ``optimizer`` builds the state's optimizer;
    ``moe``: a mixture-of-experts model's router losses (``relax.models.moe.experts.MoEConfig``; its
    routing replay has nothing to replay here).
    """

    max_length: int = 1024
    packing: bool = True
    pack_method: str = "ffd"
    truncate: bool = False
    grad_accum: int = 1
    remat: bool = True
    moe: MoEConfig = MoEConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5)
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    text_field: str = "text"

    def __post_init__(self):
        check_choice("pack_method", self.pack_method, PACK_METHODS)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
