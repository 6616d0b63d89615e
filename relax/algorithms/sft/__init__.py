"""Supervised fine-tuning (SFT) with packing: config, loss and step (docs/architecture.md, "Algorithms").

    cfg = SFTConfig(max_length=1024, packing=True)
    examples = sft_examples(cfg, read_records("data.jsonl"), tokenizer)
    state = init_sft_state(cfg, policy, key=key)
    state, out = make_sft_step(cfg)(state, sft_batch(cfg, examples, pad_id=tokenizer.pad_token_id))

or, packing the whole dataset once into rows and batching rows:
``rows = sft_rows(cfg, examples, pad_id=...)``, ``batch = relax.data.supervised.stack_rows(rows[:16])``.
"""

from relax.algorithms.sft.config import SFTConfig
from relax.algorithms.sft.loss import make_sft_loss, target_mask
from relax.algorithms.sft.step import (
    init_sft_state,
    make_sft_step,
    sft_batch,
    sft_examples,
    sft_rows,
)

__all__ = [
    "SFTConfig",
    "init_sft_state",
    "make_sft_loss",
    "make_sft_step",
    "sft_batch",
    "sft_examples",
    "sft_rows",
    "target_mask",
]
