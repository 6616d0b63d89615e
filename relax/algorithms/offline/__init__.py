"""The offline run shared by SFT, the preference trainers, reward models and distillation."""

from relax.algorithms.offline.held_out import eval_batches
from relax.algorithms.offline.run import (
    MAX_EVAL_PROMPT,
    OfflineAlgorithm,
    OfflineRunConfig,
    PairRunConfig,
    batch_iterator,
    greedy_accuracy,
    run_offline,
)

__all__ = [
    "MAX_EVAL_PROMPT",
    "OfflineAlgorithm",
    "OfflineRunConfig",
    "PairRunConfig",
    "batch_iterator",
    "eval_batches",
    "greedy_accuracy",
    "run_offline",
]
