"""Data: dataset files (``files``), prompt batches for rollouts (``prompts``, grain), SFT
examples (``supervised``) and their packing into rows (``packing``), preference pairs and unpaired rows (``pairs``). See
docs/architecture.md, "Layers"."""

from relax.data.files import Record, read_records
from relax.data.pairs import (
    Pair,
    Unpaired,
    collate_pairs,
    collate_unpaired,
    encode_pairs,
    encode_unpaired,
)
from relax.data.prompts import (
    DataConfig,
    DataSplits,
    PromptBatch,
    eval_records,
    prompt_batch,
    prompt_dataset,
    prompt_iterator,
    read_splits,
)
from relax.data.supervised import SFTExample, encode_sft, pack, pad_examples, pad_rows

__all__ = [
    "DataConfig",
    "DataSplits",
    "Pair",
    "PromptBatch",
    "Record",
    "SFTExample",
    "Unpaired",
    "collate_pairs",
    "collate_unpaired",
    "encode_pairs",
    "encode_sft",
    "encode_unpaired",
    "eval_records",
    "pack",
    "pad_examples",
    "pad_rows",
    "prompt_batch",
    "prompt_dataset",
    "prompt_iterator",
    "read_records",
    "read_splits",
]
