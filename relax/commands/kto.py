"""KTO (Kahneman-Tversky optimisation on unpaired feedback) from the command line (``relax kto``).

    relax kto                    # built-in task: reversals desirable, copies undesirable
    relax kto --model HF_DIR --data feedback.jsonl --kto.beta 0.1 --steps 1000
        # rows: prompt / completion / label (true: desirable), TRL's columns

``python examples/train_kto.py`` (and ``python -m relax kto``) is the same command, with the same flags.

Every field of ``relax.algorithms.kto.run.KTORunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.kto.run import KTORunConfig

NAME = "kto"


def parse(argv: list[str]) -> KTORunConfig:
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.kto.run import KTORunConfig, builtin_defaults

    return parse_flags(
        KTORunConfig,
        argv,
        builtin=builtin_defaults,
        real=KTORunConfig,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.kto.run import run as run_kto

    return run_kto(parse(argv))


COMMAND = Command(
    NAME,
    "KTO: Kahneman-Tversky optimisation on unpaired desirable/undesirable feedback",
    run,
    parse,
)
