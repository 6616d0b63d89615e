"""Three-stage RLHF (SFT -> reward model -> PPO or GRPO) from the command line.

    python examples/rlhf.py [flags]      # the same command as: relax rlhf [flags]

The command, its help text and its flags live in ``relax.commands.rlhf``; ``relax rlhf --help``
(or ``python examples/rlhf.py --help``) lists them.
"""

from __future__ import annotations

import sys

from relax.commands import COMMANDS
from relax.train.preemption import exit_as_terminated

COMMAND = COMMANDS["rlhf"]


def main(argv: list[str] | None = None) -> dict:
    return COMMAND.run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
