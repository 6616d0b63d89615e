"""Three-stage RLHF from the command line: SFT -> reward model -> PPO (or GRPO) against it.

    python examples/rlhf.py                         # built-in reverse task, a few minutes on CPU
    python examples/rlhf.py --algorithm grpo        # GRPO as the third stage
    python examples/rlhf.py --model HF_DIR --data DATA_DIR --sft.steps 500 --reward-model.steps 500 --ppo.steps 200
        # DATA_DIR: sft.jsonl (demonstrations), preferences.jsonl (prompt/chosen/rejected),
        # prompts.jsonl (prompt, optional answer); optional held-out <name>.eval.jsonl beside each

Stage 1 (SFT) starts from --model, stages 2 (reward model) and 3 from stage 1's export; stage 3's
reward is stage 2's model. Each stage's run is in --run-dir/<stage>; every flag of its run config
is a flag under its prefix (--sft.*, --reward-model.*, --ppo.* / --grpo.*; ``--help`` lists them).
The summary of held-out figures before and after each stage is printed and written to
--run-dir/summary.json.
"""

from __future__ import annotations

import sys

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.rlhf.run import RLHFRunConfig, builtin_defaults, real_defaults, run
from relax.train.preemption import exit_as_terminated


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run(
        parse_flags(
            RLHFRunConfig, argv, builtin=builtin_defaults, real=real_defaults, description=__doc__
        )
    )


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: the running stage saved a checkpoint; exit status 143
