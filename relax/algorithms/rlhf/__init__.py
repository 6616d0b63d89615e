"""Three-stage RLHF in one run: SFT -> reward model -> PPO or GRPO against it (``relax.algorithms.rlhf.run``)."""

from relax.algorithms.rlhf.run import (
    DATA_FILES,
    FIGURES,
    OWNED,
    OWNED_LATER,
    STAGES,
    RLHFRunConfig,
    builtin_pairs,
    figures,
    stages,
    stages_table,
    verifier_accuracy,
    write_builtin_data,
)

__all__ = [
    "DATA_FILES",
    "FIGURES",
    "OWNED",
    "OWNED_LATER",
    "RLHFRunConfig",
    "STAGES",
    "builtin_pairs",
    "figures",
    "stages",
    "stages_table",
    "verifier_accuracy",
    "write_builtin_data",
]
