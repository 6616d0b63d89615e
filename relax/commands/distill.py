"""Knowledge distillation from the command line (``relax distill``).

    relax distill                # built-in task: a fresh small student learns the base model
    relax distill --model STUDENT_DIR --teacher TEACHER_DIR --data rows.jsonl --steps 1000
        # rows: prompt / completion; --distill.divergence forward|reverse|jsd, --distill.mode on_policy (GKD)

``python examples/train_distill.py`` (and ``python -m relax distill``) is the same command, with the same flags.

Every field of ``relax.algorithms.distill.run.DistillRunConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.commands.command import Command

if TYPE_CHECKING:
    from relax.algorithms.distill.run import DistillRunConfig

NAME = "distill"


def parse(argv: list[str]) -> DistillRunConfig:
    from relax.algorithms.cli.flags import parse_flags
    from relax.algorithms.distill.run import DistillRunConfig, builtin_defaults

    return parse_flags(
        DistillRunConfig,
        argv,
        builtin=builtin_defaults,
        real=DistillRunConfig,
        description=__doc__,
        prog=f"relax {NAME}",
    )


def run(argv: list[str]) -> dict:
    from relax.algorithms.distill.run import run as run_distill

    return run_distill(parse(argv))


COMMAND = Command(
    NAME,
    "knowledge distillation from a teacher (forward/reverse KL, JSD; on-policy GKD)",
    run,
    parse,
)
