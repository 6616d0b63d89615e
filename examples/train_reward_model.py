"""Reward-model training (Bradley-Terry on preference pairs) from the command line.

    python examples/train_reward_model.py          # built-in task: pairs where reversing beats copying
    python examples/train_reward_model.py --model HF_DIR --data pairs.jsonl --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns), optional margin

The result (run_dir/final_hf) is a sequence-classification directory transformers loads
(AutoModelForSequenceClassification); ``relax.rewards.model.reward_model_reward`` scores GRPO or
PPO completions with it. Every field of ``relax.algorithms.reward_model.run.RewardModelRunConfig``
is a flag; ``--help`` lists them.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.reward_model.run import RewardModelRunConfig, builtin_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(
        parse_flags(
            RewardModelRunConfig,
            argv,
            builtin=builtin_defaults,
            real=RewardModelRunConfig,
            description=__doc__,
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)
