"""GRPO from the command line.

    python examples/train_grpo.py [flags]      # the same command as: relax grpo [flags]

The command, its help text and its flags live in ``relax.commands.grpo``; ``relax grpo --help``
(or ``python examples/train_grpo.py --help``) lists them.
"""

from __future__ import annotations

import sys

from relax.commands import COMMANDS
from relax.train.preemption import exit_as_terminated

COMMAND = COMMANDS["grpo"]


def parse_args(argv: list[str]) -> object:
    """Flags -> ``GRPORunConfig``, nothing run (``relax.commands.grpo.parse``)."""
    return COMMAND.parse(argv)


def main(argv: list[str] | None = None) -> dict:
    return COMMAND.run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
