"""Three-stage RLHF from the command line: SFT -> reward model -> PPO (or GRPO) against it (``relax rlhf``).

    relax rlhf                                   # built-in reverse task, a few minutes on CPU
    relax rlhf --algorithm grpo                  # GRPO as the third stage
    relax rlhf --model HF_DIR --data DATA_DIR --sft.steps 500 --reward-model.steps 500 --ppo.steps 200
        # DATA_DIR: sft.jsonl (demonstrations), preferences.jsonl (prompt/chosen/rejected),
        # prompts.jsonl (prompt, optional answer); optional held-out <name>.eval.jsonl beside each

``python examples/rlhf.py`` (and ``python -m relax rlhf``) is the same command, with the same flags.

Stage 1 (SFT) starts from --model, stages 2 (reward model) and 3 from stage 1's export; stage 3's
reward is stage 2's model. Each stage's run is in --run-dir/<stage>; every flag of its run config is
a flag under its prefix (--sft.*, --reward-model.*, --ppo.* / --grpo.*; ``--help`` lists them). The
summary of held-out figures before and after each stage is printed and written to
--run-dir/summary.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.rlhf.run import RLHFRunConfig

NAME = "rlhf"


def parse(argv: list[str]) -> RLHFRunConfig:
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.rlhf.run import RLHFRunConfig, builtin_defaults, real_defaults

    return parse_flags(
        RLHFRunConfig,
        argv,
        builtin=builtin_defaults,
        real=real_defaults,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.rlhf.run import run as run_rlhf

    return run_rlhf(parse(argv))


COMMAND = Command(
    NAME, "three-stage RLHF: SFT -> reward model -> PPO (or GRPO) against it", run, parse
)
