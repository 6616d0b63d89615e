"""``relax plan``: the planner's command line is ``relax.plan.cli`` (its module docstring is the help
text ``relax plan --help`` prints)."""

from __future__ import annotations

from relax.commands.command import Command

NAME = "plan"


def run(argv: list[str]) -> int:
    """``relax plan <algorithm> --target ... [flags]`` -> the exit status (0: fits, 3: does not
    fit, 2: usage error)."""
    from relax.plan.cli import main

    return main([NAME, *argv])


COMMAND = Command(NAME, "will this run fit that machine? compiled for the target, without it", run)
