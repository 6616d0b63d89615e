"""PPO with a critic from the command line.

    python examples/train_ppo.py [flags]      # the same command as: relax ppo [flags]

The command, its help text and its flags live in ``relax.commands.ppo``; ``relax ppo --help``
(or ``python examples/train_ppo.py --help``) lists them.
"""

from __future__ import annotations

import sys

from relax.commands import COMMANDS
from relax.train.preemption import exit_as_terminated

COMMAND = COMMANDS["ppo"]


def main(argv: list[str] | None = None) -> dict:
    return COMMAND.run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
