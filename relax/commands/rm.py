"""Reward-model training (Bradley-Terry on preference pairs) from the command line (``relax rm``).

    relax rm                     # built-in task: pairs where reversing beats copying
    relax rm --model HF_DIR --data pairs.jsonl --steps 1000
        # rows: prompt / chosen / rejected (strings or chat messages, TRL's columns), optional margin

``python examples/train_reward_model.py`` (and ``python -m relax rm``) is the same command, with the same flags.

The result (run_dir/final_hf) is a sequence-classification directory transformers loads
(AutoModelForSequenceClassification); ``relax.rewards.model.reward_model_reward`` scores GRPO or PPO
completions with it. Every field of ``relax.algorithms.reward_model.run.RewardModelRunConfig`` is a
flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.reward_model.run import RewardModelRunConfig

NAME = "rm"


def parse(argv: list[str]) -> RewardModelRunConfig:
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.reward_model.run import RewardModelRunConfig, builtin_defaults

    return parse_flags(
        RewardModelRunConfig,
        argv,
        builtin=builtin_defaults,
        real=RewardModelRunConfig,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.reward_model.run import run as run_reward_model

    return run_reward_model(parse(argv))


COMMAND = Command(
    NAME, "reward model: Bradley-Terry on preference pairs, exported for transformers", run, parse
)
