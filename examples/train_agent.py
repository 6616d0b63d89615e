"""Multi-turn tool-use RL from the command line.

    python examples/train_agent.py [flags]      # the same command as: relax agent [flags]

The command, its help text and its flags live in ``relax.commands.agent``; ``relax agent --help``
(or ``python examples/train_agent.py --help``) lists them.
"""

from __future__ import annotations

import sys

# The config, its defaults and the flag parser, for callers parsing flags of their own
# (tests/test_agent_run.py).
from relax.algorithms.agent.run import AgentRunConfig, builtin_defaults
from relax.algorithms.cli.flags import cli
from relax.commands import COMMANDS
from relax.train.preemption import exit_as_terminated

__all__ = ["AgentRunConfig", "builtin_defaults", "cli", "main"]

COMMAND = COMMANDS["agent"]


def main(argv: list[str] | None = None) -> dict:
    return COMMAND.run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_as_terminated(main)  # SIGTERM: a checkpoint was saved; exit status 143
