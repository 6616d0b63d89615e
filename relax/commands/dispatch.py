"""``relax <command> [flags]``: the first word picks the command of ``COMMANDS``, the rest are its
flags. ``relax --help`` lists the commands; ``relax <command> --help`` prints the command's help."""

from __future__ import annotations

import sys

from relax.commands.command import Command
from relax.commands.registry import COMMANDS

USAGE = "usage: relax <command> [flags]     (relax <command> --help: its help and every flag)"


def listing() -> str:
    """The usage line and every command with its summary."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(
        [
            USAGE,
            "",
            "Post-training of language models in pure JAX. Commands:",
            "",
            *lines,
            "",
            "`python -m relax <command>` is the same as `relax <command>`.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default: ``sys.argv[1:]``) -> the exit status. A trainer stopped by
    SIGTERM (a checkpoint saved) exits with status 143 (``SystemExit``); ``--help`` and a usage
    error from a command's flags exit through tyro's ``SystemExit`` as well."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(listing(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"relax: unknown command {argv[0]!r}\n\n{listing()}", file=sys.stderr)
        return 2
    return run(command, argv[1:])


def run(command: Command, argv: list[str]) -> int:
    """Run ``command`` on its flags -> the exit status (a trainer: 0 when its run ends)."""
    if not command.trains:
        status = command.run(argv)
        return status if isinstance(status, int) else 0
    from relax.train.preemption import exit_as_terminated

    exit_as_terminated(lambda: command.run(argv))  # SIGTERM: a checkpoint was saved; status 143
    return 0
