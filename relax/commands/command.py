"""One command of ``relax``: its name, its one-line summary, and how it parses and runs its flags.

A trainer's ``parse(argv)`` turns the flags into its run config without running anything (``--help``
prints the full help and exits 0, as every tyro command line does); ``run(argv)`` parses and runs,
returning the run's summary. ``serve`` and ``plan`` have no config of their own to hand out
(``parse`` is None): their ``run(argv)`` returns the exit status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Command:
    """An entry of ``relax.commands.COMMANDS``."""

    name: str
    """The word after ``relax`` (``relax grpo``)."""
    summary: str
    """One line for ``relax --help``."""
    run: Callable[[list[str]], object]
    """Flags -> parsed and run: a trainer's summary (a dict), or the exit status (``serve``, ``plan``)."""
    parse: Callable[[list[str]], object] | None = None
    """Flags -> the trainer's run config, nothing run; None for ``serve`` and ``plan``."""

    @property
    def trains(self) -> bool:
        """Whether this is a trainer (SIGTERM saves a checkpoint and exits 143)."""
        return self.parse is not None

    @property
    def prog(self) -> str:
        """The command as ``--help`` names it."""
        return f"relax {self.name}"
