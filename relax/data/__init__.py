"""Data: dataset files (``files``), prompt batches for rollouts (``prompts``, grain), supervised
rows (``supervised``). See docs/architecture.md, "Layers"."""

from relax.data.files import Record, read_records
from relax.data.prompts import (DataConfig, DataSplits, PromptBatch, eval_records, prompt_batch, prompt_dataset,
                                prompt_iterator, read_splits)
from relax.data.supervised import pad_examples

__all__ = ["DataConfig", "DataSplits", "PromptBatch", "Record", "eval_records", "pad_examples", "prompt_batch",
           "prompt_dataset", "prompt_iterator", "read_records", "read_splits"]
